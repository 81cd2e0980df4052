"""Models whose loading code is more than key sets: tied weights, version-aware `_load_from_state_dict`, load hooks,
non-persistent buffers; and the layouts of fine-tuning (a new head, a backbone inside a detector). The oracle tests
load files into these with torch itself and compare with what `inspect --model` says.
"""

from __future__ import annotations

import torch
from torch import nn


class TiedLM(nn.Module):
    """GPT-2's layout in small: the output head is the embedding matrix (one Parameter, two names)."""

    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(torch.relu(self.block(self.wte(ids)))))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


class VersionedLinear(nn.Linear):
    """A layer that renamed its weight in version 2 and still reads files written by version 1 (`w`, `b`), the way
    torch's own modules handle their old formats."""

    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if (local_metadata or {}).get("version", 1) < 2:
            for old, new in (("w", "weight"), ("b", "bias")):
                if prefix + old in state_dict:
                    state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class Versioned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = VersionedLinear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.proj(x))


class HookNet(nn.Module):
    """Fills a buffer older files lack from a pre-hook, and drops a key it no longer uses."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_load_state_dict_pre_hook(self._upgrade)

    @staticmethod
    def _upgrade(module, state_dict, prefix, *args) -> None:
        state_dict.setdefault(prefix + "scale", torch.ones(4))
        state_dict.pop(prefix + "legacy_temperature", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.mask


class Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).mean((2, 3))


class Classifier(Features):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(super().forward(x))


class Detector(nn.Module):
    """A classifier's feature extractor inside a bigger model, with a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = Features()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class Twins(nn.Module):
    """Two layers of one shape: a mapping by position cannot tell them apart."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.second(torch.relu(self.first(x)))))


class Criterion(nn.Module):
    """A LightningModule's layout: the network under `model.`, a weighted loss beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Classifier(5)
        self.criterion = nn.CrossEntropyLoss(weight=torch.ones(5))


# --- Hugging Face models built from small configs (transformers is a test dependency) -------------------------

def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)).eval()


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                        max_position_embeddings=32, tie_word_embeddings=True,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()


def _minilm_config():
    from transformers import BertConfig

    return BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      vocab_size=64, max_position_embeddings=32)


def minilm(add_pooling_layer: bool = False):
    """all-MiniLM-L6-v2's architecture in small; sentence-transformers uses it without the pooler."""
    from transformers import BertModel

    torch.manual_seed(0)
    return BertModel(_minilm_config(), add_pooling_layer=add_pooling_layer).eval()
