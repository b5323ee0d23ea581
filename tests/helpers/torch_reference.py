"""The PyTorch oracle: torchscale's BEiT3 with the retrieval heads of unilm's BEiT3ForRetrieval.

torchscale imports timm (for drop_path), and timm needs a torchvision that does not import beside the pinned torch,
so a stand-in `timm.models.layers.drop_path` (the same function) is put in sys.modules first.
"""

from __future__ import annotations

import sys
import types

import numpy as np


def _import_torchscale():
    """Imports torchscale's BEiT3 with a stand-in `timm.models.layers.drop_path`, then removes the stand-in so
    that libraries probing for a real timm (transformers does, through importlib.util.find_spec) are not misled."""
    stand_in = "timm" not in sys.modules

    def drop_path(x, drop_prob: float = 0.0, training: bool = False):
        if drop_prob == 0.0 or not training:
            return x
        keep = 1 - drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep

    if stand_in:
        timm = types.ModuleType("timm")
        models = types.ModuleType("timm.models")
        layers = types.ModuleType("timm.models.layers")
        layers.drop_path = drop_path
        timm.models, models.layers = models, layers
        sys.modules.update({"timm": timm, "timm.models": models, "timm.models.layers": layers})
    try:
        from torchscale.architecture.config import EncoderConfig
        from torchscale.model.BEiT3 import BEiT3
    finally:
        if stand_in:
            for name in ("timm", "timm.models", "timm.models.layers"):
                sys.modules.pop(name, None)
    return EncoderConfig, BEiT3


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

EncoderConfig, BEiT3 = _import_torchscale()


class TorchRetrieval(torch.nn.Module):
    """BEiT3 + bias-free heads + logit_scale, as unilm's BEiT3ForRetrieval (key layout of the official files)."""

    def __init__(self, cfg):
        super().__init__()
        args = EncoderConfig(
            vocab_size=cfg.vocab_size, multiway=True, layernorm_embedding=False, normalize_output=True,
            no_output_layer=True, drop_path_rate=0.0, encoder_embed_dim=cfg.embed_dim,
            encoder_attention_heads=cfg.num_heads, encoder_ffn_embed_dim=cfg.ffn_dim, encoder_layers=cfg.num_layers,
            checkpoint_activations=False, img_size=cfg.image_size, patch_size=cfg.patch_size, in_chans=3,
            max_source_positions=cfg.max_text_positions,
        )
        self.beit3 = BEiT3(args)
        d = cfg.embed_dim
        self.language_head = torch.nn.Linear(d, d, bias=False)
        self.vision_head = torch.nn.Linear(d, d, bias=False)
        self.logit_scale = torch.nn.Parameter(torch.ones([]) * np.log(1 / 0.07))

    def encode_image(self, pixels_nchw):
        out = self.beit3(textual_tokens=None, visual_tokens=pixels_nchw)
        return F.normalize(self.vision_head(out["encoder_out"][:, 0, :]), dim=-1), out

    def encode_text(self, ids, padding_mask):
        out = self.beit3(textual_tokens=ids, visual_tokens=None, text_padding_position=padding_mask)
        return F.normalize(self.language_head(out["encoder_out"][:, 0, :]), dim=-1), out

    def hidden_states(self, ids=None, padding_mask=None, pixels_nchw=None):
        """Input of every layer and the last layer's output (torchscale's encoder_states)."""
        b = self.beit3
        if ids is not None:
            x, mask, split = b.text_embed(ids), padding_mask, 0
        else:
            x, mask, split = b.vision_embed(pixels_nchw), None, -1
        out = b.encoder(src_tokens=None, encoder_padding_mask=mask, token_embeddings=x,
                        multiway_split_position=split, return_all_hiddens=True)
        return out["encoder_states"]


def random_reference(cfg, seed: int = 0) -> TorchRetrieval:
    """A reference model with every parameter random (LayerNorm weights and biases included)."""
    torch.manual_seed(seed)
    model = TorchRetrieval(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("logit_scale"):
                p.fill_(float(np.log(1 / 0.07)) + 0.3)
            elif "norm" in name or "_ln" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    return model


def state_dict_numpy(model: torch.nn.Module) -> dict:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
