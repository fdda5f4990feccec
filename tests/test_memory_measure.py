"""The step measurement: saved bytes against a hand count, parameter/gradient/optimizer bytes, the report."""

import torch
from torch import nn

from coordinated_prep.memory.measure import SavedBytes, measure_step, tensor_bytes
from coordinated_prep.memory_tool.report import format_report, relative


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def test_saved_bytes_of_linear_relu_linear_by_hand():
    """x (8 x 5) does not require grad, so autograd saves, in float32:
    - first Linear (addmm): its input x, 8*5*4 = 160 bytes (W1.t() is not needed: x has no gradient);
    - ReLU: its output h, 8*7*4 = 224 bytes;
    - second Linear (addmm): h again (the same storage, counted once) and W2.t() (a parameter: not counted).
    """
    net = _mlp()
    with SavedBytes(exclude=list(net.parameters())) as meter:
        net(torch.randn(8, 5))
    assert meter.nbytes == 160 + 224
    with SavedBytes() as counting_parameters:
        net(torch.randn(8, 5))
    assert counting_parameters.nbytes == 160 + 224 + 7 * 3 * 4


def test_saved_bytes_with_an_input_that_requires_grad():
    """With x requiring a gradient, the first addmm also saves W1.t() (a parameter, not counted)."""
    net = _mlp()
    with SavedBytes(exclude=list(net.parameters())) as meter:
        net(torch.randn(8, 5, requires_grad=True))
    assert meter.nbytes == 160 + 224


def test_measure_step_counts_parameters_gradients_and_momentum():
    net = _mlp()
    params = (5 * 7 + 7 + 7 * 3 + 3) * 4
    m = measure_step(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), torch.randn(8, 5),
                     torch.randint(0, 3, (8,)), steps=2, warmup=1)
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (params, params, params)
    assert m.activation_bytes == 160 + 224
    assert m.peak_kind == "cpu_estimate" and m.peak_bytes == 3 * params + 160 + 224
    assert len(m.step_times) == 2 and m.step_s > 0


def test_tensor_bytes_counts_each_storage_once():
    t = torch.zeros(10)
    assert tensor_bytes([t, t[2:], None, torch.zeros(3, dtype=torch.float64)]) == 40 + 24


def _row(memory, act, step):
    return {"config": f"m b2 8px {memory}", "trainable": "m", "width": None, "batch_size": 2, "size": 8,
            "memory": memory, "activation_bytes": act, "param_bytes": 2**20, "grad_bytes": 2**20,
            "optimizer_bytes": 2**20, "peak_bytes": 3 * 2**20 + act, "peak_kind": "cpu_estimate", "step_min_s": step,
            "step_s": step, "step_times": [step]}


def test_the_report_compares_each_mode_with_none():
    rows = [_row("none", 3 * 2**20, 1.0), _row("checkpoint", 2**20, 1.25)]
    rel = relative(rows)
    assert rel[1]["activation_ratio"] == 3.0 and rel[1]["time_ratio"] == 1.25
    text = format_report({"experiment": "x.yaml", "device": "CPU", "threads": 2, "torch": "2", "steps": 3,
                          "warmup": 1, "rows": rows})
    assert "3.00x" in text and "+25%" in text and "estimate" in text
    assert relative([_row("checkpoint", 1, 1.0)])[0]["activation_ratio"] is None  # no none row to compare with
