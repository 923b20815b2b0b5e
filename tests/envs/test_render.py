"""Frames: every env draws its state as colored cells, written as PNGs that Pillow reads back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rollstream.shared.envs.registry import default_custom_envs, make_env
from rollstream.shared.envs.render import CELL_PX, CellStyle, draw_grid, save_frame
from rollstream.shared.envs.text import format_reply

TAGS = sorted(default_custom_envs())


@pytest.mark.parametrize("tag", TAGS)
def test_frames_are_written_and_follow_the_player(tag: str, tmp_path: Path) -> None:
    env = make_env(tag, default_custom_envs())
    obs, _ = env.reset(seed=4)
    observations, frames = [obs], [env.render_rgb()]
    for action in env.action_names:
        obs, _, terminated, truncated, _ = env.step(format_reply(action))
        observations.append(obs)
        frames.append(env.render_rgb())
        if terminated or truncated:
            break
    rows = observations[0].split("\n")
    for i, frame in enumerate(frames):
        save_frame(frame, tmp_path / f"{i}.png")
        with Image.open(tmp_path / f"{i}.png") as png:
            assert png.format == "PNG" and png.mode == "RGB"
            assert png.size == (len(rows[0]) * CELL_PX, len(rows) * CELL_PX)
            assert np.array_equal(np.asarray(png), frame)
        # Magenta marks a symbol without a style: every symbol of the env must have one.
        assert not np.all(frame == (255, 0, 255), axis=-1).any()
    # A frame changes exactly when the state text changes.
    for before, after, obs_before, obs_after in zip(frames, frames[1:], observations, observations[1:]):
        assert np.array_equal(before, after) == (obs_before == obs_after)
    assert len(set(observations)) > 1, "no action moved the player; pick another seed"


def test_draw_grid_marks_objects_on_their_tile() -> None:
    styles = {".": CellStyle((0, 0, 200)), "P": CellStyle((0, 0, 200), (200, 0, 0))}
    image = draw_grid([".P"], styles, cell_px=8)
    assert image.shape == (8, 16, 3) and image.dtype == np.uint8
    assert tuple(image[4, 4]) == (0, 0, 200) and tuple(image[4, 12]) == (200, 0, 0)
    assert tuple(image[0, 8]) == (0, 0, 200), "the marker is inset, the tile shows around it"


def test_save_frame_rejects_non_images(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        save_frame(np.zeros((4, 4), np.uint8), tmp_path / "x.png")
    with pytest.raises(ValueError, match="uint8"):
        save_frame(np.zeros((4, 4, 3), np.float32), tmp_path / "x.png")
