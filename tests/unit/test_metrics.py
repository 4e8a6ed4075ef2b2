import torch
from torchmetrics.classification import MulticlassAccuracy

from lightning_ulysses.training.metrics import NextTokenAccuracy, Perplexity, SequenceParallel, TokenCrossEntropy


def test_wrapper_accumulates_through_forward_and_update():
    for call in ("forward", "update"):
        metric = SequenceParallel(MulticlassAccuracy(num_classes=4, average="micro"))
        for prediction in (torch.tensor([[1, 2]]), torch.tensor([[0, 0]])):  # accuracy 1.0, then 0.0
            getattr(metric, call)(prediction, torch.tensor([[1, 2]])) if call == "update" else metric(prediction, torch.tensor([[1, 2]]))
        assert metric.compute().item() == 0.5, call


def test_token_metrics_are_sums_over_valid_next_tokens():
    """Labels as the batch holds them (unshifted, as Hugging Face reads them): position t is scored on label t+1."""
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[1, 2, -100, 3, 4], [-100, -100, 0, 6, 5]])
    predicted, targets = logits[:, :-1], labels[:, 1:]
    valid = targets != -100
    expected = torch.nn.functional.cross_entropy(predicted[valid], targets[valid])
    for metric, value in ((TokenCrossEntropy(), expected), (Perplexity(), expected.exp()),
                          (NextTokenAccuracy(), (predicted[valid].argmax(-1) == targets[valid]).float().mean())):
        metric.update(logits[:1], labels[:1])
        metric.update(logits[1:], labels[1:])
        assert torch.allclose(metric.compute(), value, atol=1e-6)
