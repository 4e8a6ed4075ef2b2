"""The model-family matrix: every causal-LM family we can build small is exact under Ulysses SP, or refused.

One 4-rank launch. For each family (tests/distributed/families.py) at SP 2 and SP 4 (KV heads replicated where
they are fewer than SP): the model is checked and prepared as the strategy does it; plain rows with unevenly
masked labels, right-padded rows and packed rows (documents restarting their positions; compared where the
unprepared model keeps them apart) are cut by the sharder, and the loss (1e-5) and the gradients summed over the SP group (relative 1e-4) are compared with the
same model on the full sequence in one process. Sliding windows (5 tokens) and chunks (8) are shorter than the
rows (24) and cross the shards, so they are applied, not skipped; the hybrid and recurrent families run their
Mamba / Gated-DeltaNet / convolution / RG-LRU / RWKV layers on whole rows (attention/mixers.py). A refusal must name its fix. A family that
is neither exact nor refused fails the test: no family may train silently wrong.

A few families also train through the Trainer with SGD on ZeRO-2 and ZeRO-3 at SP 2 (weights within 1e-4 of the
update after 3 steps). How ZeRO scales gradients over the SP group does not depend on the family (it sees only
flat parameter buffers), so the stages are covered by these few; the families differ in what the attention swap
and the sharded positions have to get right, which the matrix covers for all of them.

The table in docs/model-families.md is rendered from the outcome; the test fails when the file is out of date
(rewrite it with LIGHTNING_ULYSSES_WRITE_FAMILIES=1).
"""

from __future__ import annotations

import os
import re

import pytest

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tests.distributed.families import FAMILIES, NOT_IN_MATRIX, SEQ_LEN, SINCE_5_25, UNEVEN, settings_of, tiny_config
from tests.distributed.harness import ROOT
from tests.distributed.pool import shared
from tests.distributed.reference import assert_training_matches, reference_training

WORKER = ROOT / "tests" / "distributed" / "workers" / "families.py"
TABLE = ROOT / "docs" / "model-families.md"
SIZES = (2, 4)


def _spec() -> dict:
    return {
        "sequence_parallel_sizes": list(SIZES),
        "families": [{"family": name, "eval": FAMILIES[name].get("eval", False),
                      "float64": FAMILIES[name].get("float64", False), "overrides": settings_of(name),
                      "left_padded": name in LEFT_PADDED, "mixers": name in MIXER_FAMILIES}
                     for name in FAMILIES]
        + [{"family": f"{name}@uneven", "overrides": {**settings_of(name), **UNEVEN[name]}, "mixers": True,
            "layers_only": name not in UNEVEN_MATRIX} for name in UNEVEN],
        "transport_mixers": list(TRANSPORT_MIXERS),
        "training_cases": [
            {"name": f"{family}_zero{stage}", "model": f"family:{family}", "kv_heads": 2, "sp": 2, "stage": stage,
             "steps": 3, "batch_size": 2, "seq_len": 12}
            for family in TRAINED for stage in (2, 3)
        ] + [
            # the memory engine on a hybrid (whole-rows Gated DeltaNet layers recomputed in backward) and on a
            # sliding-window family: layer checkpointing with host offload, tiled MLP
            {"name": f"{family}_zero3_memory", "model": f"family:{family}", "kv_heads": 2, "sp": 2, "stage": 3,
             "steps": 3, "batch_size": 2, "seq_len": 12, "strategy_kwargs": {"memory": MEMORY}}
            for family in MEMORY_FAMILIES
        ],
    }


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


# Left-padded rows too: positions numbered from the mask (OPT), counted from RoPE's arange (Llama), chunks from the
# first real token (Llama 4), windows (Mistral), ALiBi over real tokens (BLOOM), inline rotary attention (Falcon), a
# hybrid's mixers (Qwen3-Next), sinks in eager attention (GPT-OSS), a Mamba2 mixer split by heads (its mask applied
# to the shard, then to the convolution's output on whole rows).
LEFT_PADDED = ("opt", "llama", "llama4_text", "mistral", "bloom", "falcon", "qwen3_next", "gpt_oss", "mamba2")

# Learned positions, plain GQA, MoE; a Gated-DeltaNet hybrid; sinks + sliding windows in eager attention; ALiBi inline.
TRAINED = ("opt", "gpt2", "qwen3_moe", "qwen3_next", "gpt_oss", "bloom")
MEMORY_FAMILIES = ("qwen3_next", "mistral")
MEMORY = {"activation_checkpointing": True, "offload_activations": True, "tiled_mlp": True, "mlp_tile_tokens": 3}


# Hybrids whose mixers' units do not divide by SP 2 or 4 (families.py `UNEVEN`), through the whole matrix: a Gated
# DeltaNet grouped by key head (Qwen3-Next's in_proj_qkvz), Mamba2 with groups of B and C, a short convolution; the
# other declared families' mixers (and the other Gated DeltaNet and Mamba2 layouts) layer by layer and on a ring.
UNEVEN_MATRIX = ("qwen3_next", "mamba2", "lfm2")

# Split mixers also exchanged through the copy engine's transport (emulated on gloo) at SP 4: evenly (every piece
# equal: the transport moves them) and unevenly (unequal pieces: the collective, which takes per-rank sizes).
TRANSPORT_MIXERS = {"lfm2": True, "qwen3_next@uneven": False}  # name: whether the transport moves its pieces

# Families whose token mixers that are not attention are also checked layer by layer (`mixer_errors`): one layer of
# each kind on its shard against the same layer on the whole rows, output and input gradient; and how they run,
# split by heads (a kind of lightning_ulysses/mixers/ recognises them) or on whole rows (families.py: their entry's
# "mixers").
MIXER_FAMILIES = tuple(name for name, settings in FAMILIES.items() if "mixers" in settings)
SPLIT_FAMILIES = tuple(name for name in MIXER_FAMILIES if FAMILIES[name]["mixers"] == "split")


# In the shared 4-rank launch (pool.py): its ranks' start-up (4 × ~17 s of CPU) is paid once for every job.
JOB = shared(4, "families", WORKER, _spec(), timeout=600)


def test_every_token_mixer_layer_is_exact_on_its_own(outcome):
    for family in MIXER_FAMILIES:
        for sp in SIZES:
            layers = [rank["mixers"][family][sp] for rank in outcome]
            assert layers[0], (family, sp, "no mixer found")
            for path in layers[0]:
                output = max(layer[path]["output_error"] for layer in layers)
                gradient = max(layer[path]["gradient_error"] for layer in layers)
                assert output < 1e-5 and gradient < 1e-5, (family, sp, path, output, gradient)


def test_split_mixers_are_exact_on_a_ring_and_split_over_every_sp_rank(outcome):
    # Hybrid Ulysses × ring (SP 4 = Ulysses 2 × ring 2, zig-zag shards): the mixers' heads are their own, so they
    # split over all four SP ranks (two-stage exchanges, rows put back in natural order: mixers/ranks.py).
    for family in MIXER_FAMILIES:
        layers = [rank["mixer_rings"][family] for rank in outcome]
        assert layers[0], (family, "no mixer found")
        for path in layers[0]:
            output = max(layer[path]["output_error"] for layer in layers)
            gradient = max(layer[path]["gradient_error"] for layer in layers)
            assert output < 1e-5 and gradient < 1e-5, (family, path, output, gradient)
            expected = "split" if family in SPLIT_FAMILIES else "whole rows"
            assert layers[0][path]["ran"] == expected, (family, path, layers[0][path]["ran"])


def test_hybrids_run_with_the_cache_transformers_makes_by_default():
    # `model(**batch)` as users write it: transformers then creates a cache in every forward, training included,
    # and hands it to each mixer; the matrix must run with it (a cache the model made for itself is no error).
    for family in MIXER_FAMILIES:
        assert tiny_config(family, **settings_of(family)).get_text_config().use_cache is True, family


def test_the_matrix_covers_every_causal_lm():
    # Every causal LM of the installed transformers is built by the matrix or listed with the reason it is not; a
    # family newer than 5.24 is left out only where the installed release lacks it.
    mapping = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert not mapping - set(FAMILIES) - set(NOT_IN_MATRIX), "new causal LMs: add them to families.py"
    assert not set(FAMILIES) & set(NOT_IN_MATRIX)
    assert set(FAMILIES) | SINCE_5_25 >= mapping - set(NOT_IN_MATRIX)
    assert set(FAMILIES) <= mapping and set(NOT_IN_MATRIX) <= mapping  # (no stale names)


def test_declared_mixers_run_split_by_heads(outcome):
    for family in MIXER_FAMILIES:
        for sp in SIZES:
            ran = {path: layer["ran"] for path, layer in outcome[0]["mixers"][family][sp].items()}
            expected = "split" if family in SPLIT_FAMILIES else "whole rows"
            assert set(ran.values()) == {expected}, (family, sp, ran)


def test_packed_documents_restart_split_mixers_and_are_refused_on_whole_rows(outcome):
    # Split mixers run each packed document on its own: the matrix compares their packed rows with every document
    # run alone (workers/families.py `document_by_document_loss`). A mixer left on whole rows would carry state from
    # one document into the next: refused, naming the fix.
    for family in SPLIT_FAMILIES:
        if family not in ("mamba2", "mamba", "falcon_mamba"):  # these models take no position_ids: no documents
            assert "packed" in outcome[0]["families"][family][SIZES[0]]["batches"], family
    for family in MIXER_FAMILIES:
        for sp in SIZES:
            for path, layer in outcome[0]["mixers"][family][sp].items():
                if layer["ran"] == "whole rows":
                    assert "unpacked rows" in layer["packed_refusal"], (family, sp, path)


# Mamba2 mixers and their `n_groups` groups of B and C (mixers/mamba2.py): where the groups do not divide by the SP
# size, each rank takes the one group its heads read whole, and convolves it: 32 of the convolution's 96 channels
# in these tiny layers (in real ones a few %: Mamba2-2.7B's B and C are 256 of 5376 channels).
SHARED_GROUPS = {"mamba2": 1, "bamba": 1, "granitemoehybrid": 1, "zamba2": 1, "falcon_h1": 2, "nemotron_h": 8}


def test_a_split_mixer_does_one_sp_th_of_the_work_on_every_rank(outcome):
    # Scaling is a claim too: the FLOPs of forward and backward are exactly 1/SP of the whole layer's, its input and
    # output projections see seq/SP rows, and the activations it saves for backward are 1/SP of the whole layer's, up
    # to the channel indices and narrowed weights a split keeps (a fixed ~1 KB here, where the layer saves ~11 KB per
    # rank) and the shared channels every rank holds whole (Mamba's step, B and C after x_proj's sum over the group:
    # Jamba saves 1.105/SP of its whole layer's at SP 4). A projection whose partial products are summed over the SP
    # group (Mamba's x_proj) sees every row of 1/SP of its input channels, the second half of a low-rank pair (Kimi's
    # f_b_proj and g_b_proj) every row of 1/SP of its output channels: their FLOPs are in the first claim.
    # Where Mamba2's groups of B and C do not divide by SP, their convolution, its saved activations, the norm's sums
    # over the SP group and the scan's C·Bᵀ (ours computes it once per group, not per head: mixers/ssd.py) come on
    # top; measured here: 4.5% more FLOPs than 1/SP at SP 2, 7.6% at SP 4 (n_groups 1), and 38% and 71% more saved
    # bytes (what the forward saves: the scan keeping only its inputs, the whole layer keeps far less than with
    # transformers' scan, and B and C, convolved and kept by every rank that reads them, are a larger part of it).
    for family in SPLIT_FAMILIES:
        for sp in SIZES:
            shared = SHARED_GROUPS.get(family, sp) % sp != 0
            for rank in outcome:
                for path, layer in rank["mixers"][family][sp].items():
                    work, whole = layer["work"], layer["whole_work"]
                    if shared:
                        assert whole["flops"] < work["flops"] * sp <= 1.1 * whole["flops"], (family, sp, work, whole)
                        assert work["saved_bytes"] * sp <= 1.8 * whole["saved_bytes"], (family, sp, path, work, whole)
                    else:
                        assert work["flops"] * sp == whole["flops"], (family, sp, path, work, whole)
                        assert work["saved_bytes"] * sp <= 1.15 * whole["saved_bytes"], (family, sp, path, work, whole)
                    assert layer["projections"], (family, sp, path)
                    for projection in layer["projections"]:
                        rows = work["rows"][projection], whole["rows"][projection]
                        assert rows[0] * sp == rows[1] == SEQ_LEN, (family, sp, path, projection, rows)


@pytest.mark.parametrize("family", list(UNEVEN))
def test_mixers_whose_units_do_not_divide_split_unevenly_and_exactly(outcome, family):
    # ⌈U/SP⌉ or ⌊U/SP⌋ units per rank (mixers/channels.py), exchanged in pieces of per-rank sizes (mixers/ranks.py):
    # the model on plain, padded and packed rows at SP 2 and 4 (`UNEVEN_MATRIX`), each mixer layer on its own, and
    # on a ring (Ulysses 2 × ring 2, zig-zag shards), all split and all exact.
    name = f"{family}@uneven"
    for sp in SIZES:
        if family in UNEVEN_MATRIX:
            assert classify(outcome, name, sp) == ("exact", ""), (name, sp, classify(outcome, name, sp))
            expected = ["plain", "padded"] + (["packed"] if family != "mamba2" else [])  # (Mamba2 takes no positions)
            assert outcome[0]["families"][name][sp]["batches"] == expected, (name, sp)
        for path in outcome[0]["mixers"][name][sp]:
            layers = [rank["mixers"][name][sp][path] for rank in outcome]
            assert {layer["ran"] for layer in layers} == {"split"}, (name, sp, path)
            assert max(max(layer["output_error"], layer["gradient_error"]) for layer in layers) < 1e-5, (name, sp)
            units = layers[0]["units"]
            assert units % sp != 0, (name, sp, units)  # (the variant does not divide, or it tests nothing new)
            assert [layer["local_units"] for layer in layers] == \
                [-(-units // sp) if rank % sp < units % sp else units // sp for rank in range(len(outcome))], (name, sp)
    for path in outcome[0]["mixer_rings"][name]:
        layers = [rank["mixer_rings"][name][path] for rank in outcome]
        assert {layer["ran"] for layer in layers} == {"split"}, (name, path)
        assert max(max(layer["output_error"], layer["gradient_error"]) for layer in layers) < 1e-5, (name, path)


@pytest.mark.parametrize("family", list(UNEVEN))
def test_an_uneven_split_gives_each_rank_only_its_units_work(outcome, family):
    # Each rank's projections see seq/SP rows; its convolution and recurrence run on its ⌈U/SP⌉ or ⌊U/SP⌋ units
    # alone: no rank does more than the ⌈U/SP⌉ units' share of the whole layer's FLOPs, the ranks with fewer units
    # do less, and together they do the layer once, plus the key heads (groups of B and C) that several ranks'
    # value heads (heads) read, convolved on each, once per head where a rank's heads read two groups unequally.
    # Measured, FLOPs and saved bytes (what the forward saves) of all ranks over the whole layer's: the short
    # convolution 1.0 and 1.10 at SP 4; Qwen3-Next's 1.008 and 1.055 at SP 2, 1.003 and 1.025 at SP 4; Mamba2's 1.107
    # and 1.84 at SP 2 (5 and 4 heads, each with its own copy of B and C), 1.036 and 1.44 at SP 4. (Our Mamba2 scan
    # computes C·Bᵀ once per group, mixers/ssd.py: a rank whose heads each read their own copy computes it once per
    # head, so the ranks with ⌈U/SP⌉ heads do up to 5% more than their share of the whole layer's, which computes it
    # once per group, and the ranks together 11% more at SP 2; the scan keeping only its inputs, the whole layer
    # keeps far less than with transformers' scan, and B and C kept by each rank that reads them are most of what
    # the ranks keep: 1.84 times the whole layer's at SP 2, Mamba2 and Falcon-H1 alike.)
    name = f"{family}@uneven"
    for sp in SIZES:
        for path in outcome[0]["mixers"][name][sp]:
            layers = [rank["mixers"][name][sp][path] for rank in outcome[:sp]]  # (ranks 0..sp-1: one SP group)
            whole = layers[0]["whole_work"]
            units = layers[0]["units"]
            flops = [layer["work"]["flops"] for layer in layers]
            most = -(-units // sp) / units  # the largest rank's share (the projections' seq/SP rows are within it)
            for layer in layers:
                assert layer["work"]["flops"] <= 1.07 * most * whole["flops"], (name, sp, layer["work"], whole)
                for projection in layer["projections"]:
                    assert layer["work"]["rows"][projection] * sp == whole["rows"][projection] == SEQ_LEN
            assert whole["flops"] <= sum(flops) <= 1.12 * whole["flops"], (name, sp, flops, whole["flops"])
            assert max(flops) > min(flops), (name, sp, flops)  # ⌊U/SP⌋-unit ranks do less than ⌈U/SP⌉-unit ones
            saved = sum(layer["work"]["saved_bytes"] for layer in layers)
            assert saved <= 1.9 * whole["saved_bytes"], (name, sp, saved, whole["saved_bytes"])


def test_a_split_mixer_takes_the_copy_engine_for_equal_pieces_and_the_collective_for_unequal_ones(outcome):
    for name, moved in TRANSPORT_MIXERS.items():
        for path in outcome[0]["mixer_transports"][name]:
            layers = [rank["mixer_transports"][name][path] for rank in outcome]
            assert max(max(layer["output_error"], layer["gradient_error"]) for layer in layers) < 1e-5, (name, path)
            # (forward and backward: both exchanges of each projection, or none)
            assert all((layer["transport_launches"] > 0) == moved for layer in layers), (name, path, layers)


def classify(ranks: list[dict], family: str, sp: int) -> tuple[str, str]:
    outcomes = [rank["families"][family][sp] for rank in ranks]
    status = {o["status"] for o in outcomes}
    assert len(status) == 1, f"{family} SP {sp}: ranks disagree {outcomes}"  # a refusal must be on every rank alike
    first = outcomes[0]
    if first["status"] == "failed":
        return "wrong", first["why"]
    if first["status"] == "ran":
        loss = max(o["loss_error"] for o in outcomes)
        grad = max(o["grad_error"] for o in outcomes)
        if loss < 1e-5 and grad < 1e-4:
            return "exact", ""
        return "wrong", f"loss error {loss:.2e}, gradient error {grad:.2e}"
    return first["status"], first["why"]


FIXES = ("sequence_parallel_size=1", "attn_implementation='sdpa'", "UlyssesAttention", "attn_temperature_tuning=False")


def test_no_family_is_silently_wrong(outcome):
    wrong = {}
    for family in FAMILIES:
        for sp in SIZES:
            status, why = classify(outcome, family, sp)
            if status == "wrong" or status == "refused" and not any(fix in why for fix in FIXES):
                wrong[(family, sp)] = (status, why)
    assert not wrong, wrong


def test_the_families_users_train_are_exact(outcome):
    # The families the issues list, and the reasons the others are refused (a refusal is no regression to hide).
    for family in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma", "gemma3_text", "phi", "phi3",
                   "gpt2", "gpt_neox", "gptj", "opt", "biogpt", "stablelm", "starcoder2", "olmo", "olmo2", "olmo3",
                   "cohere", "cohere2", "granite", "smollm3", "glm", "glm4", "glm4_moe", "ernie4_5", "seed_oss",
                   "apertus", "hunyuan_v1_dense", "ministral", "exaone4",
                   # soft-capping, sinks; sliding windows shorter than the rows; chunks and the NoPE temperature
                   "gemma2", "gpt_oss", "llama4_text",
                   # linear attention, state-space and convolution mixers on whole rows
                   "qwen3_next", "qwen3_5_text", "kimi_linear", "minimax", "lfm2", "mamba", "falcon_mamba", "mamba2", "jamba",
                   "falcon_h1", "granitemoehybrid", "nemotron_h", "bamba", "zamba2", "recurrent_gemma", "rwkv",
                   # attention computed inline (families/): ALiBi, Falcon's own branches, GPT-Neo's local windows
                   "bloom", "mpt", "falcon", "gpt_neo", "xglm",
                   # decoders added by transformers 5.24 and 5.25 (ergo, MiniCPM5-MoE, Param2-MoE: 5.25 only)
                   "bailing_hybrid", "lara_mini", "lfm2_moe", "lfm3", "mimo_v2_flash", "laguna",
                   "gemma4_text", "kolibri1", "ergo", "minicpm5_moe", "param2moe"):
        if family in SINCE_5_25 and family not in FAMILIES:  # (on 5.24)
            continue
        for sp in SIZES:
            assert classify(outcome, family, sp)[0] == "exact", (family, sp, classify(outcome, family, sp))
        assert outcome[0]["families"][family][SIZES[0]]["batches"][:2] == ["plain", "padded"], family
    # packed rows compared too
    for family in ("llama", "mistral", "gemma3_text", "qwen3", "llama4_text", "gemma2", "falcon", "gpt_neo"):
        assert outcome[0]["families"][family][SIZES[0]]["batches"][:3] == ["plain", "padded", "packed"], family
    for family in LEFT_PADDED:  # and left-padded rows
        assert outcome[0]["families"][family][SIZES[0]]["batches"][-1] == "left_padded", family


@pytest.mark.parametrize("case", [f"{family}_zero{stage}" for family in TRAINED for stage in (2, 3)]
                         + [f"{family}_zero3_memory" for family in MEMORY_FAMILIES])
def test_families_train_exactly_through_the_trainer(outcome, case):
    family = case.split("_zero")[0]
    ranks = [rank["training"][case] for rank in outcome]
    steps = [[ranks[0]["records"][t]["sample_index"], ranks[2]["records"][t]["sample_index"]] for t in range(3)]
    assert_training_matches(ranks, reference_training(2, 12, steps, kind=f"family:{family}"))


def render(ranks: list[dict]) -> str:
    lines = [
        "# Model families under Ulysses sequence parallelism",
        "",
        "Generated by `tests/distributed/test_families.py` (transformers "
        f"{ranks[0]['transformers_version']}): every family below was built as a tiny random model and run at SP 2"
        " and SP 4 against the same model on the whole sequence. *exact*: loss within 1e-5 and gradients within"
        " 1e-4 (relative); *refused*: `UlyssesDeepSpeedStrategy` stops before training, naming the fix; *untested*:"
        " the tiny recipe could not build it here.",
        "",
        "*Token mixers* (linear attention, state-space layers, short convolutions): *split by heads*: each rank runs"
        " its share of the heads (or channels) on whole rows, 1/SP of the layer's work (⌈U/SP⌉ or ⌊U/SP⌋ of its U"
        " heads where SP does not divide them); *whole rows*: every rank runs the whole layer (exact, but its work"
        " does not shrink with SP).",
        "",
        "| family | SP 2 | SP 4 | token mixers | why |",
        "| --- | --- | --- | --- | --- |",
    ]
    for family in sorted(FAMILIES):
        cells = [classify(ranks, family, sp) for sp in SIZES]
        why = next((w for _, w in cells if w), "")
        if FAMILIES[family].get("eval"):
            why = "compared in eval mode: in training its router samples experts at random (no exact reference)"
        if FAMILIES[family].get("float64"):
            why = "compared in float64: its two subtracted softmax maps amplify fp32 rounding to 1e-4 of some gradients"
        why = why.split(". ")[0].replace("|", "\\|")[:200]
        mixers = {layer["ran"] for sp in SIZES for layer in ranks[0].get("mixers", {}).get(family, {}).get(sp, {}).values()}
        mixers = " / ".join(sorted("split by heads" if ran == "split" else ran for ran in mixers))
        lines.append(f"| {family} | {cells[0][0]} | {cells[1][0]} | {mixers} | {why} |")
    return "\n".join(lines) + "\n"


def test_the_table_is_up_to_date(outcome):
    text = render(outcome)
    if os.environ.get("LIGHTNING_ULYSSES_WRITE_FAMILIES"):
        TABLE.parent.mkdir(exist_ok=True)
        TABLE.write_text(text)
    # (the outcomes, not the transformers release that generated them: the same table must hold for every release
    # the dependency allows, so a newer release that changes a row fails here, one that changes nothing does not)
    assert TABLE.exists() and _without_version(TABLE.read_text()) == _without_version(text), \
        "rewrite with LIGHTNING_ULYSSES_WRITE_FAMILIES=1"


def _without_version(table: str) -> str:
    """The table without the release that generated it, and without the rows of families the installed release
    lacks (SINCE_5_25 on 5.24)."""
    absent = SINCE_5_25 - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = [line for line in table.splitlines() if not any(line.startswith(f"| {name} |") for name in absent)]
    return re.sub(r"\(transformers [0-9][^)]*\)", "(transformers)", "\n".join(rows), count=1)
