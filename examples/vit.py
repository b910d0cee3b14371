"""A timm-style Vision Transformer built by hand, and a synthetic image classification task.

``timm`` is not importable here (its ``torchvision`` dependency has no CPU wheel on this
machine's index), so the model is written out with timm's module names (``patch_embed.proj``,
``cls_token``, ``pos_embed``, ``blocks.<i>.norm1`` / ``attn`` / ``norm2`` / ``mlp``, ``norm``,
``head``): the metric keys read as they would on a ``timm.create_model("vit_tiny_patch16_224")``
model. The blocks sit in an ``nn.Sequential``, as timm's do.

The entry point is rank-deficient on purpose: a 4x4 patch of an RGB image has 3 * 4 * 4 = 48
values, so the patch embedding ``Conv2d(3, d, 4, 4)`` maps every patch into a 48-dimensional
subspace of the ``d = 192`` stream (plus the bias, the class token and the position
embeddings). The stream at ``p_0`` has a covariance of rank at most ``48 + 1 + tokens``,
well under ``d`` -- the open problem of issue 33 for the ``sigma_min`` ratios.

    >>> model = ViT(image_size=32, patch_size=4, dim=192, depth=2, heads=3, num_classes=4)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ViT", "synthetic_images"]


class PatchEmbed(nn.Module):
    """Non-overlapping ``patch_size`` patches, each mapped linearly to ``dim`` (timm's name)."""

    def __init__(self, patch_size: int, dim: int, in_chans: int = 3) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, patches, dim)


class Attention(nn.Module):
    """Multi-head self-attention over all tokens (no mask), timm's ``qkv`` / ``proj``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """timm's pre-norm ViT block: ``x = x + attn(norm1(x)); x = x + mlp(norm2(x))``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A class-token ViT: patches + class token + learned positions, ``depth`` blocks in an
    ``nn.Sequential``, the final ``norm`` and a linear ``head`` on the class token.

    Args:
        image_size: side of the square input image.
        patch_size: side of a patch (4: 3 * 4 * 4 = 48 values per patch).
        dim: the stream width (192 as in ViT-Tiny).
        depth: blocks.
        heads: attention heads (``dim`` divisible by it).
        num_classes: outputs of the head.
    """

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        dim: int = 192,
        depth: int = 4,
        heads: int = 3,
        num_classes: int = 4,
        mlp_ratio: float = 4.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size or dim % heads:
            raise ValueError("image_size must divide by patch_size and dim by heads")
        tokens = (image_size // patch_size) ** 2 + 1
        self.patch_embed = PatchEmbed(patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def synthetic_images(
    n: int, image_size: int = 32, num_classes: int = 4, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy RGB images and their labels: class ``c`` is a bright square in quadrant
    ``c % 4`` tinted by colour channel ``c % 3``, over Gaussian noise (learnable in a few dozen
    steps, not trivially: the square's place within its quadrant varies)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    images = 0.5 * torch.randn(n, 3, image_size, image_size, generator=g)
    half, side = image_size // 2, image_size // 4
    for i, c in enumerate(labels.tolist()):
        r0 = (c % 4 // 2) * half + int(torch.randint(0, half - side + 1, (1,), generator=g))
        c0 = (c % 4 % 2) * half + int(torch.randint(0, half - side + 1, (1,), generator=g))
        images[i, c % 3, r0 : r0 + side, c0 : c0 + side] += 2.0
    return images, labels
