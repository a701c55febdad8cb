"""FedProx gradient against autograd of the written-out loss; training and model registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from quorumfl.core.data.datasets import Dataset, load_dataset
from quorumfl.core.models import arrays_to_model, build_model, model_to_arrays
from quorumfl.errors import ConfigError, ModelError
from quorumfl.training.local import evaluate, proximal_term, train


def test_fedprox_gradient_matches_written_out_loss() -> None:
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10, seed=1)
    global_params = [p.detach().clone() + 0.05 * torch.randn_like(p) for p in model.parameters()]
    x, y, mu = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,)), 0.3

    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y) + proximal_term(model, global_params, mu)
    loss.backward()
    ours = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    # Reference: grad of CE by autograd, plus the closed form mu * (w - w_g) of the proximal term.
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    for got, p, wg in zip(ours, model.parameters(), global_params, strict=True):
        expected = p.grad + mu * (p.detach() - wg)  # type: ignore[operator]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_proximal_term_value() -> None:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(2.0)
    zeros = [torch.zeros_like(p) for p in model.parameters()]
    assert proximal_term(model, zeros, 0.5).item() == pytest.approx(0.25 * (1 + 1 + 4))


def test_mu_zero_equals_plain_sgd() -> None:
    train_set, _ = load_dataset("digits")
    small = train_set.subset(np.arange(200))
    a = build_model("mlp", small.input_shape, 10, seed=0)
    b = build_model("mlp", small.input_shape, 10, seed=0)
    train(a, small, epochs=1, batch_size=32, learning_rate=0.05, proximal_mu=0.0, seed=1)
    train(b, small, epochs=1, batch_size=32, learning_rate=0.05, seed=1)
    for k, v in model_to_arrays(a).items():
        np.testing.assert_array_equal(v, model_to_arrays(b)[k])


def test_training_learns_digits() -> None:
    data, _ = load_dataset("digits")
    model = build_model("mlp", data.input_shape, 10, seed=0)
    before = evaluate(model, data).accuracy
    train(model, data.subset(np.arange(1200)), epochs=5, batch_size=32, learning_rate=0.05)
    after = evaluate(model, data.subset(np.arange(1200, 1797)))
    assert before < 0.3 and after.accuracy > 0.85


@pytest.mark.parametrize("name", ["mlp", "mlp-tanh", "cnn", "mlp-wide"])
def test_models_build_deterministically(name: str) -> None:
    a = model_to_arrays(build_model(name, (1, 8, 8), 10, seed=4))
    b = model_to_arrays(build_model(name, (1, 8, 8), 10, seed=4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    out = build_model(name, (1, 8, 8), 10)(torch.zeros(2, 1, 8, 8))
    assert out.shape == (2, 10)


def test_mlp_tanh_is_the_mlp_with_tanh() -> None:
    relu, tanh = build_model("mlp", (1, 8, 8), 10, seed=3), build_model("mlp-tanh", (1, 8, 8), 10, seed=3)
    assert [type(m).__name__ for m in tanh] == ["Flatten", "Linear", "Tanh", "Linear", "Tanh", "Linear"]
    a, b = model_to_arrays(relu), model_to_arrays(tanh)  # same shapes and initial weights
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_model_errors() -> None:
    with pytest.raises(ConfigError, match="unknown model 'resnet9000'"):
        build_model("resnet9000", (1, 8, 8), 10)
    model = build_model("mlp", (1, 8, 8), 10)
    arrays = model_to_arrays(model)
    first = next(iter(arrays))
    with pytest.raises(ModelError, match="shape"):
        arrays_to_model(model, {**arrays, first: np.zeros((1, 1), np.float32)})
    with pytest.raises(ModelError, match="missing"):
        arrays_to_model(model, {k: v for k, v in arrays.items() if k != first})
    with pytest.raises(ConfigError, match="local-epochs must be >= 1"):
        train(model, Dataset("d", np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64), 10), epochs=0, batch_size=1, learning_rate=0.1)
