"""Built-in models with synthetic batches, and loading of user models given as `package.module:factory`."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import itertools
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from planner.types import ModelLoadError, PlannerError, UnknownModelError

__all__ = ["BUILTIN_MODELS", "CHAR_SEQ", "CHAR_VOCAB", "DEFAULT_MODEL", "Batch", "Workload", "build_workload",
           "digits_data", "stdlib_text", "text_windows"]

Batch = tuple[torch.Tensor, torch.Tensor]
"""An (inputs, targets) pair."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model with a synthetic batch and a loss: everything profiling, benchmarks and training need."""

    name: str
    module: nn.Module
    batch_size: int
    make_batch: Callable[[int, torch.Generator], Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __post_init__(self) -> None:
        """Reject values no workload can have."""
        if not isinstance(self.module, nn.Module):
            kind = type(self.module).__name__
            raise PlannerError(f"workload {self.name!r}: module must be a torch.nn.Module, got {kind}")
        if not _positive_int(self.batch_size):
            size = self.batch_size
            raise PlannerError(f"workload {self.name!r}: batch size must be a positive integer, got {size!r}")

    def batch(self, seed: int = 0) -> Batch:
        """Return the synthetic batch of `batch_size` samples drawn deterministically from `seed`."""
        return self.make_batch(self.batch_size, torch.Generator().manual_seed(seed))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run the module on `inputs` and return the scalar loss against `targets`."""
        return self.loss_fn(self.module(inputs), targets)


def _positive_int(value: object) -> bool:
    """Whether `value` is an int (not a bool) of at least 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic data and losses (module-level functions, so built-in workloads can be pickled).


def _image_batch(batch_size: int, generator: torch.Generator, *, size: int, num_classes: int) -> Batch:
    """Random normal images [B, 3, size, size] and random class targets [B]."""
    images = torch.randn((batch_size, 3, size, size), generator=generator)
    return images, torch.randint(0, num_classes, (batch_size,), generator=generator)


def _vector_batch(batch_size: int, generator: torch.Generator, *, features: int, num_classes: int) -> Batch:
    """Random normal vectors [B, features] and random class targets [B]."""
    inputs = torch.randn((batch_size, features), generator=generator)
    return inputs, torch.randint(0, num_classes, (batch_size,), generator=generator)


def _token_batch(batch_size: int, generator: torch.Generator, *, seq_len: int, vocab: int, shifted: bool) -> Batch:
    """Random token ids [B, seq_len]; targets are the next tokens if `shifted`, else independent random ids."""
    if shifted:
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    tokens = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    return tokens, torch.randint(0, vocab, (batch_size, seq_len), generator=generator)


def _classification_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits [B, C] against class ids [B]."""
    return F.cross_entropy(output, targets)


def _token_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of per-token logits [B, S, V] against token ids [B, S]."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------------------------------
# ResNet (torchvision layout, v1.5 bottleneck), with a CIFAR or ImageNet stem.


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.downsample(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, with a residual connection (ResNet-50+)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.downsample = _shortcut(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.downsample(x))


def _shortcut(in_planes: int, out_planes: int, stride: int) -> nn.Module:
    """Identity when shapes match, else a strided 1x1 convolution with batch norm."""
    if stride == 1 and in_planes == out_planes:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_planes, out_planes, 1, stride, bias=False), nn.BatchNorm2d(out_planes))


class ResNet(nn.Module):
    """ResNet with a CIFAR stem (3x3 conv, no max-pool) or an ImageNet stem (7x7/2 conv + max-pool)."""

    def __init__(
        self, block: type[BasicBlock | Bottleneck], depths: list[int], num_classes: int, imagenet: bool
    ) -> None:
        super().__init__()
        if imagenet:
            self.stem = nn.Sequential(
                nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
            )
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        stages: list[nn.Module] = []
        in_planes = 64
        for i, (planes, depth) in enumerate(zip((64, 128, 256, 512), depths, strict=True)):
            blocks: list[nn.Module] = []
            for j in range(depth):
                blocks.append(block(in_planes, planes, 2 if i > 0 and j == 0 else 1))
                in_planes = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits [B, num_classes]."""
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _resnet(name: str, batch_size: int, *, bottleneck: bool, imagenet: bool) -> Workload:
    """ResNet-18 or ResNet-50 workload, CIFAR-sized (32x32, 10 classes) or ImageNet-sized (224x224, 1000 classes)."""
    block, depths = (Bottleneck, [3, 4, 6, 3]) if bottleneck else (BasicBlock, [2, 2, 2, 2])
    size, classes = (224, 1000) if imagenet else (32, 10)
    return Workload(
        name=name,
        module=ResNet(block, depths, classes, imagenet),
        batch_size=batch_size,
        make_batch=functools.partial(_image_batch, size=size, num_classes=classes),
        loss_fn=_classification_loss,
    )


# ---------------------------------------------------------------------------------------------------------------------
# VGG-16 with batch norm, CIFAR variant.

_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def _vgg16(name: str, batch_size: int) -> Workload:
    """VGG-16-BN for 32x32 images with a 512-512-512-10 classifier."""
    layers: list[nn.Module] = []
    channels = 3
    for item in _VGG16:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, int(item), 3, padding=1), nn.BatchNorm2d(int(item)), nn.ReLU()]
            channels = int(item)
    classifier = [nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)]
    return Workload(
        name=name,
        module=nn.Sequential(*layers, nn.Flatten(), *classifier),
        batch_size=batch_size,
        make_batch=functools.partial(_image_batch, size=32, num_classes=10),
        loss_fn=_classification_loss,
    )


# ---------------------------------------------------------------------------------------------------------------------
# LSTM language model (PTB "medium" shape).


class LSTMLanguageModel(nn.Module):
    """Embedding (`embed` wide, default `dim`), multi-layer LSTM and a linear decoder back to the vocabulary."""

    def __init__(self, vocab: int = 10000, dim: int = 650, layers: int = 2, embed: int | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed or dim)
        self.lstm = nn.LSTM(embed or dim, dim, num_layers=layers, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return next-token logits [B, S, vocab] for token ids [B, S]."""
        hidden, _ = self.lstm(self.embedding(tokens))
        return self.decoder(hidden)


def _lstm(name: str, batch_size: int) -> Workload:
    """2-layer, 650-wide LSTM language model over a 10k vocabulary, 35-token sequences."""
    return Workload(
        name=name,
        module=LSTMLanguageModel(),
        batch_size=batch_size,
        make_batch=functools.partial(_token_batch, seq_len=35, vocab=10000, shifted=True),
        loss_fn=_token_loss,
    )


# ---------------------------------------------------------------------------------------------------------------------
# BERT-style encoder; every parameter lives in an nn.Linear, nn.LayerNorm or nn.Embedding.


@dataclass(frozen=True)
class BertShape:
    """Sizes of a BERT-style encoder."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    seq_len: int
    vocab: int = 30522
    max_positions: int = 512


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v/out projections."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over the whole sequence of x [B, S, H] (no mask)."""
        b, s, h = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        context = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)))
        return self.out(context.transpose(1, 2).reshape(b, s, h))


class EncoderLayer(nn.Module):
    """Post-LayerNorm transformer layer (as in BERT): attention, then a GELU feed-forward."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.attention = SelfAttention(hidden, heads)
        self.attention_norm = nn.LayerNorm(hidden)
        self.ffn_in = nn.Linear(hidden, ffn)
        self.ffn_out = nn.Linear(ffn, hidden)
        self.ffn_norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to x [B, S, H]."""
        x = self.attention_norm(x + self.attention(x))
        return self.ffn_norm(x + self.ffn_out(F.gelu(self.ffn_in(x))))


class Bert(nn.Module):
    """Token + position embeddings, a stack of encoder layers and a per-token linear head to the vocabulary."""

    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        if shape.hidden % shape.heads:
            raise ValueError(f"hidden size {shape.hidden} is not divisible by {shape.heads} heads")
        self.token_embedding = nn.Embedding(shape.vocab, shape.hidden)
        self.position_embedding = nn.Embedding(shape.max_positions, shape.hidden)
        self.embedding_norm = nn.LayerNorm(shape.hidden)
        self.encoder = nn.Sequential(*(EncoderLayer(shape.hidden, shape.heads, shape.ffn) for _ in range(shape.layers)))
        self.head = nn.Linear(shape.hidden, shape.vocab)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return per-token logits [B, S, vocab] for token ids [B, S]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding_norm(self.token_embedding(tokens) + self.position_embedding(positions))
        return self.head(self.encoder(x))


def _bert(name: str, batch_size: int, shape: BertShape) -> Workload:
    """BERT-style encoder with a masked-LM-like token classification head."""
    return Workload(
        name=name,
        module=Bert(shape),
        batch_size=batch_size,
        make_batch=functools.partial(_token_batch, seq_len=shape.seq_len, vocab=shape.vocab, shifted=False),
        loss_fn=_token_loss,
    )


# ---------------------------------------------------------------------------------------------------------------------
# MLP.


def _mlp(name: str, batch_size: int) -> Workload:
    """MLP 784-1024-1024-1024-10 with ReLU."""
    widths = (784, 1024, 1024, 1024)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return Workload(
        name=name,
        module=nn.Sequential(*layers, nn.Linear(1024, 10)),
        batch_size=batch_size,
        make_batch=functools.partial(_vector_batch, features=784, num_classes=10),
        loss_fn=_classification_loss,
    )


@functools.cache
def _digits_data() -> Batch:
    """scikit-learn's handwritten digits (1797 real 8x8 images, 10 classes): pixels scaled to [0, 1], flat."""
    try:
        from sklearn.datasets import load_digits  # deferred: only the digits model loads scikit-learn
    except ImportError:  # pragma: no cover - scikit-learn is a dependency
        raise PlannerError("the digits model needs scikit-learn: pip install scikit-learn") from None
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target, dtype=torch.long)


def digits_data() -> Batch:
    """All of scikit-learn's digits as (pixels [1797, 64] in [0, 1], classes [1797])."""
    return _digits_data()


def _digits_batch(batch_size: int, generator: torch.Generator) -> Batch:
    """`batch_size` digits drawn uniformly with replacement."""
    x, y = _digits_data()
    index = torch.randint(0, len(x), (batch_size,), generator=generator)
    return x[index], y[index]


def _digits(name: str, batch_size: int) -> Workload:
    """MLP 64-512-512-10 with ReLU on the real digits: a small task whose training loss really falls."""
    return Workload(
        name=name,
        module=nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)),
        batch_size=batch_size,
        make_batch=_digits_batch,
        loss_fn=_classification_loss,
    )


# ---------------------------------------------------------------------------------------------------------------------
# A character-level language model on real text that every machine has: the Python standard library's own sources.

#: Characters of the text model: the 7-bit ASCII codes (the standard library's sources are ASCII nearly throughout);
#: any other byte reads as code 0.
CHAR_VOCAB = 128
#: Characters per sequence of the text model.
CHAR_SEQ = 64
#: At most this many bytes of training and of held-out text (every `_HELD_OUT_EVERY`-th file, in sorted order, is
#: held out).
_TEXT_TRAIN_BYTES, _TEXT_EVAL_BYTES, _HELD_OUT_EVERY = 4 << 20, 1 << 19, 10


@functools.cache
def stdlib_text() -> tuple[torch.Tensor, torch.Tensor]:
    """The Python standard library's sources as character codes: (training, held-out), int64 tensors.

    The `.py` files under the standard library's folder (`sysconfig`), without its tests and installed packages,
    sorted by path; every tenth file is held out, so the held-out loss is on code the model never saw. At most
    4 MiB of training text and 512 KiB held out. The text is whatever this Python ships: the same on every
    machine with the same Python version.

    Raises:
        PlannerError: the standard library's sources are not there (an installation without them).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    train, held_out = bytearray(), bytearray()
    for i, path in enumerate(files):
        into, limit = (held_out, _TEXT_EVAL_BYTES) if i % _HELD_OUT_EVERY == 0 else (train, _TEXT_TRAIN_BYTES)
        if len(into) < limit:
            into += path.read_bytes()[: limit - len(into)]
        if len(train) >= _TEXT_TRAIN_BYTES and len(held_out) >= _TEXT_EVAL_BYTES:
            break
    if len(train) < 64 * CHAR_SEQ or len(held_out) < 8 * CHAR_SEQ:
        raise PlannerError(f"the Python standard library's sources under {root} hold too little text for the "
                           "character model; use a Python installation that ships them")

    def codes(text: bytearray) -> torch.Tensor:
        raw = torch.frombuffer(text, dtype=torch.uint8).long()  # a copy: the bytes stay untouched
        return torch.where(raw < CHAR_VOCAB, raw, torch.zeros_like(raw))

    return codes(train), codes(held_out)


def text_windows(text: torch.Tensor, starts: torch.Tensor) -> Batch:
    """Windows of `CHAR_SEQ` characters from `starts`, and the characters after each (the targets)."""
    index = starts[:, None] + torch.arange(CHAR_SEQ + 1)[None, :]
    chars = text[index]
    return chars[:, :-1].contiguous(), chars[:, 1:].contiguous()


def _text_batch(batch_size: int, generator: torch.Generator) -> Batch:
    """`batch_size` windows of the training text at random places."""
    train, _ = stdlib_text()
    return text_windows(train, torch.randint(0, len(train) - CHAR_SEQ - 1, (batch_size,), generator=generator))


def _charlm(name: str, batch_size: int) -> Workload:
    """A character-level LSTM (2 layers, 256 wide) on the standard library's sources."""
    return Workload(name=name, module=LSTMLanguageModel(vocab=CHAR_VOCAB, dim=256, embed=64), batch_size=batch_size,
                    make_batch=_text_batch, loss_fn=_token_loss)


def _cnn(name: str, batch_size: int) -> Workload:
    """A small CIFAR-sized CNN (four 3x3 convolutions with batch norm, two Linear layers).

    Its Kronecker factors stay below 1200 x 1200, so K-FAC runs on a CPU in a benchmark's time.
    """

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    module = nn.Sequential(
        *block(3, 32), *block(32, 32), nn.MaxPool2d(2),
        *block(32, 64), *block(64, 128), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(128 * 4, 256), nn.ReLU(inplace=True), nn.Linear(256, 10),
    )
    return Workload(
        name=name,
        module=module,
        batch_size=batch_size,
        make_batch=functools.partial(_image_batch, size=32, num_classes=10),
        loss_fn=_classification_loss,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Registry and loading.


@dataclass(frozen=True)
class _Builtin:
    """A built-in model: its description, default batch size and builder (name, batch_size) -> Workload."""

    description: str
    default_batch: int
    build: Callable[[str, int], Workload]


_BUILTINS: dict[str, _Builtin] = {
    "resnet18": _Builtin(
        "ResNet-18, CIFAR-sized (3x32x32, 10 classes)",
        16,
        functools.partial(_resnet, bottleneck=False, imagenet=False),
    ),
    "resnet18-imagenet": _Builtin(
        "ResNet-18, ImageNet layout (3x224x224, 1000 classes)",
        2,
        functools.partial(_resnet, bottleneck=False, imagenet=True),
    ),
    "resnet50": _Builtin(
        "ResNet-50, CIFAR-sized (3x32x32, 10 classes)",
        8,
        functools.partial(_resnet, bottleneck=True, imagenet=False),
    ),
    "resnet50-imagenet": _Builtin(
        "ResNet-50, ImageNet layout (3x224x224, 1000 classes)",
        2,
        functools.partial(_resnet, bottleneck=True, imagenet=True),
    ),
    "vgg16": _Builtin("VGG-16 with batch norm, CIFAR-sized (3x32x32, 10 classes)", 16, _vgg16),
    "lstm": _Builtin("2-layer LSTM language model, PTB medium shape (vocab 10k, 650 wide, 35 tokens)", 8, _lstm),
    "bert": _Builtin(
        "BERT-base encoder (768 wide, 12 layers, 12 heads) with a token head, 128 tokens",
        2,
        functools.partial(_bert, shape=BertShape(hidden=768, layers=12, heads=12, ffn=3072, seq_len=128)),
    ),
    "bert-small": _Builtin(
        "BERT-style encoder (256 wide, 4 layers, 4 heads) with a token head, 128 tokens",
        4,
        functools.partial(_bert, shape=BertShape(hidden=256, layers=4, heads=4, ffn=1024, seq_len=128)),
    ),
    "bert-tiny": _Builtin(
        "BERT-style encoder (128 wide, 2 layers, 2 heads) with a token head, 64 tokens",
        4,
        functools.partial(_bert, shape=BertShape(hidden=128, layers=2, heads=2, ffn=512, seq_len=64)),
    ),
    "cnn": _Builtin("Small CNN: 4 convolutions (32-128 channels) and 2 Linear layers, CIFAR-sized", 32, _cnn),
    "mlp": _Builtin("MLP 784-1024-1024-1024-10 on random vectors", 64, _mlp),
    "digits": _Builtin("MLP 64-512-512-10 on scikit-learn's handwritten digits (1797 real 8x8 images)", 64, _digits),
    "charlm": _Builtin("Character-level 2-layer LSTM (256 wide, 64 characters) on the Python standard library's "
                       "own sources (real text, held-out files)", 16, _charlm),
}

BUILTIN_MODELS: dict[str, str] = {name: spec.description for name, spec in _BUILTINS.items()}
"""Built-in model names and their one-line descriptions."""

DEFAULT_MODEL = "resnet18"

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def build_workload(name: str, *, batch_size: int | None = None, seed: int = 0) -> Workload:
    """Build a built-in model by name, or a user model given as `package.module:factory`.

    Parameters are initialised from `seed` without disturbing the global RNG; `batch_size` None keeps the default.
    """
    if batch_size is not None and not _positive_int(batch_size):
        raise PlannerError(f"batch size must be a positive integer, got {batch_size!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if ":" in name:
            workload = _load_factory(name)
            return workload if batch_size is None else dataclasses.replace(workload, batch_size=batch_size)
        builtin = _BUILTINS.get(name)
        if builtin is None:
            raise _unknown(name)
        return builtin.build(name, builtin.default_batch if batch_size is None else batch_size)


def _unknown(name: str) -> PlannerError:
    """Return the error for a name that is neither a built-in model nor a `package.module:factory` spec."""
    valid = ", ".join(BUILTIN_MODELS)
    if "." in name or "/" in name:
        return ModelLoadError(
            f"invalid --model {name!r}: expected a built-in name ({valid}) or 'package.module:factory'"
        )
    close = difflib.get_close_matches(name, BUILTIN_MODELS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UnknownModelError(f"unknown model {name!r}{hint}; valid names: {valid}, or 'package.module:factory'")


def _load_factory(spec: str) -> Workload:
    """Import `package.module:factory`, call the factory with no arguments and check it returns a Workload."""
    module_name, _, attr = spec.partition(":")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr):
        raise ModelLoadError(
            f"invalid --model {spec!r}: expected 'package.module:factory' (a dotted module path, a colon, a callable)"
        )
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelLoadError(
            f"cannot import {module_name!r} for --model {spec}: {exc} (is the package on PYTHONPATH?)"
        ) from exc
    except Exception as exc:
        raise ModelLoadError(
            f"importing {module_name!r} for --model {spec} failed: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ModelLoadError(f"module {module_name!r} has no attribute {attr!r} (--model {spec}); check the name")
        target = getattr(target, part)
    if not callable(target):
        raise ModelLoadError(f"--model {spec}: {attr!r} is a {type(target).__name__}, not a callable factory")
    try:
        workload = target()
    except Exception as exc:
        raise ModelLoadError(f"factory --model {spec} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(workload, Workload):
        raise ModelLoadError(
            f"factory --model {spec} returned {type(workload).__name__}, expected a planner.models.Workload "
            "(wrap the module: Workload(name=..., module=..., batch_size=..., make_batch=..., loss_fn=...))"
        )
    if spec not in _TRIED:  # once per process: workers and benches build the same model many times
        _trial_step(spec, workload)
        _TRIED.add(spec)
    return workload


#: The `package.module:factory` specs whose trial step passed in this process.
_TRIED: set[str] = set()


def _shapes(value: object) -> str:
    """The shapes of a tensor or of the tensors in a tuple/list/dict, for messages."""
    if isinstance(value, torch.Tensor):
        return "x".join(map(str, value.shape)) or "scalar"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_shapes(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shapes(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def _trial_step(spec: str, workload: Workload) -> None:
    """One step of a user's workload on a copy of its module and a batch of at most 2, before any worker starts:
    a model that cannot train fails here in one line naming the call (make_batch, forward, loss, backward) and
    the shapes, instead of in a worker's traceback."""
    if not any(p.requires_grad for p in workload.module.parameters()):
        raise ModelLoadError(f"--model {spec}: the module has no trainable parameters, so there are no gradients "
                             "to exchange; give a model with parameters (requires_grad=True)")
    n = min(workload.batch_size, 2)
    where = f"--model {spec}"
    try:
        inputs, targets = workload.make_batch(n, torch.Generator().manual_seed(0))
    except Exception as exc:
        raise ModelLoadError(f"{where}: make_batch({n}, generator) raised {type(exc).__name__}: {exc}") from exc
    module = copy.deepcopy(workload.module)  # the trial leaves the user's module (grads, BatchNorm stats) as it was
    try:
        output = module(inputs)
    except Exception as exc:
        raise ModelLoadError(f"{where}: the forward pass on make_batch's inputs of shape {_shapes(inputs)} raised "
                             f"{type(exc).__name__}: {exc}") from exc
    try:
        loss = workload.loss_fn(output, targets)
    except Exception as exc:
        raise ModelLoadError(f"{where}: loss_fn(output of shape {_shapes(output)}, targets of shape "
                             f"{_shapes(targets)}) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ModelLoadError(f"{where}: loss_fn must return a scalar tensor that depends on the parameters, got "
                             f"{_shapes(loss)}" + ("" if not isinstance(loss, torch.Tensor) or loss.requires_grad
                                                   else " that does not require grad"))
    try:
        loss.backward()
    except Exception as exc:
        raise ModelLoadError(f"{where}: backward of the loss raised {type(exc).__name__}: {exc}") from exc
