"""benchmarks/accelerator.py without an accelerator: the torchscale loss builds every tensor on its inputs' device (a
CPU tensor beside CUDA logits stopped the train part on the GPU), and the command line picks the parts, the sizes
and one process per measured unit."""

import common
import torch
from torch.overrides import TorchFunctionMode


class _Devices(TorchFunctionMode):
    """Records the device of every tensor any torch function returns."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.add(t.device.type)
        return out


def test_torch_contrastive_loss_builds_every_tensor_on_the_inputs_device():
    # "meta" stands in for CUDA on a host without one: tensors that are not on the CPU, with shapes and no data.
    text, image = torch.empty(6, 8, device="meta"), torch.empty(6, 8, device="meta")
    scale = torch.empty((), device="meta")
    with _Devices() as mode:
        loss = common.torch_contrastive_loss(text, image, scale)
    assert loss.device.type == "meta" and loss.shape == ()
    assert mode.seen == {"meta"}


def test_torch_contrastive_loss_on_cpu_is_the_symmetric_infonce():
    g = torch.Generator().manual_seed(0)
    text = torch.nn.functional.normalize(torch.randn(5, 4, generator=g), dim=1)
    image = torch.nn.functional.normalize(torch.randn(5, 4, generator=g), dim=1)
    scale = torch.tensor(2.0)
    logits = scale.exp() * text @ image.T
    t2i = -torch.log_softmax(logits, 1).diagonal().mean()
    i2t = -torch.log_softmax(logits.T, 1).diagonal().mean()
    assert torch.allclose(common.torch_contrastive_loss(text, image, scale), 0.5 * (t2i + i2t), atol=1e-6)
