"""The positions the sharder fills in are the ones each family numbers a row with when given none.

Every family of the model-family matrix, on left-padded rows without `position_ids`, single process: the model's
logits on the user's batch equal its logits on the batch the sharder prepared (positions filled in by the
strategy's rule for that family), at every real token. Most families count `0..seq-1` with the padding (BioGPT
too, although its embedding module can count real tokens: its model forward passes `arange`); OPT counts real
tokens only, and `0..seq-1` would shift its learned position embeddings by the padding.
"""

from __future__ import annotations

import pytest
import torch

from lightning_ulysses.adapters import position_rule_of
from lightning_ulysses.batch.sharding import SequenceSharder
from tests.distributed.families import FAMILIES, SEQ_LEN, VOCAB, family_model, tiny_model

PADDING = (5, 0, 9)  # left padding of each row

# Families whose own forward fails on these rows with an attention mask, before anything of ours runs (both are
# refused under sequence parallelism for other reasons: docs/model-families.md); held to failing, so that the list
# is dropped when transformers fixes them.
OWN_FORWARD_FAILS = {
    "dory": "its attention's mask holds 28 keys for the 24 tokens (a size mismatch in SDPA; transformers 5.25)",
    "xlstm": "a size mismatch in its mLSTM backend (an expanded size of 4 against 8; transformers 5.25)",
}


def _left_padded_batch() -> dict:
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, VOCAB, (len(PADDING), SEQ_LEN), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, pad in enumerate(PADDING):
        input_ids[row, :pad], attention_mask[row, :pad] = 0, 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - set(OWN_FORWARD_FAILS)))
def test_filled_positions_are_the_familys_own(name):
    try:
        model = family_model(name).eval()
    except Exception as error:  # the families the matrix reports as "untested" too
        pytest.skip(f"cannot be built small here: {type(error).__name__}")
    batch = _left_padded_batch()
    sharder = SequenceSharder(1, 0, position_rule=position_rule_of([model]))
    with torch.no_grad():
        own = model(**batch).logits
        filled = model(**sharder(batch)).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(filled[real], own[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(OWN_FORWARD_FAILS))
def test_the_families_left_out_still_fail_on_their_own(name):
    with pytest.raises(RuntimeError, match="size"), torch.no_grad():
        family_model(name).eval()(**_left_padded_batch())


def test_opt_needs_its_rule():
    """Without the rule (`0..seq-1`) a left-padded OPT row is numbered differently: the rule is what makes it exact."""
    model = tiny_model("opt").eval()
    batch = _left_padded_batch()
    with torch.no_grad():
        own = model(**batch).logits
        counted = model(**SequenceSharder(1, 0)(batch)).logits
    real = batch["attention_mask"].bool()
    assert not torch.allclose(counted[real], own[real], atol=1e-3)


def test_models_numbering_rows_differently_are_refused():
    with pytest.raises(ValueError, match="position_ids in your batches"):
        position_rule_of([tiny_model("opt"), tiny_model("llama")])
