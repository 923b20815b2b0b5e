"""Grid states as RGB images: each text symbol is a colored square, PNG frames written with Pillow."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

Color = tuple[int, int, int]

CELL_PX = 32
_UNKNOWN = (255, 0, 255)  # magenta: a symbol without a style shows up instead of vanishing


@dataclass(frozen=True)
class CellStyle:
    """How one symbol is drawn: a background square, optionally a smaller square on top (player, box)."""

    background: Color
    marker: Color | None = None


def draw_grid(rows: Sequence[str], styles: Mapping[str, CellStyle], cell_px: int = CELL_PX) -> np.ndarray:
    """An (H, W, 3) uint8 image of a text grid, one `cell_px` square per character."""
    if not rows:
        raise ValueError("draw_grid: empty grid")
    width = max(len(row) for row in rows)
    image = np.zeros((len(rows) * cell_px, width * cell_px, 3), np.uint8)
    # The marker is inset by a quarter cell on each side, so it reads as an object on a tile.
    inset = cell_px // 4
    for r, row in enumerate(rows):
        for c, symbol in enumerate(row):
            style = styles.get(symbol, CellStyle(_UNKNOWN))
            cell = image[r * cell_px : (r + 1) * cell_px, c * cell_px : (c + 1) * cell_px]
            cell[:] = style.background
            # A 1px darker grid line keeps neighbouring cells of one color apart.
            cell[-1, :] = cell[:, -1] = [v // 2 for v in style.background]
            if style.marker is not None:
                cell[inset : cell_px - inset, inset : cell_px - inset] = style.marker
    return image


def save_frame(rgb: np.ndarray, path: str | os.PathLike[str]) -> None:
    """Write an (H, W, 3) uint8 image as a PNG file."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"save_frame: expected an (H, W, 3) uint8 array, got {rgb.shape} {rgb.dtype}")
    Image.fromarray(rgb).save(path, format="PNG")
