"""Image prompts, for the targets mlx-lm takes images for (its `mlx_lm.processors`).

The prompt text and the image files go through mlx-lm's processor and the model's
`embed_inputs` as `mlx_lm.generate --image` sends them: each image placeholder of the prompt
becomes the image's rows. Only the prefill runs those rows; the reply is drafted and
verified from token ids as for a text prompt, so the drafter needs nothing of images.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.processors import PROCESSORS, load_processor
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .chat_format import encode_prompt


def image_prompt(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    config: dict,
    prompt: str,
    files: list[str | Path],
    templated: bool = False,
) -> tuple[list[int], mx.array]:
    """(the prompt's token ids, one input row per id) for `prompt` (with one placeholder per
    image; `templated`: rendered by the chat template, which wrote its special tokens) and
    the image `files` in order; `config` is the model's config.json. One-line ValueErrors
    for a model that takes no images, a file that is not an image, or placeholders that do
    not match the files."""
    processor = load_processor(model, config)
    if processor is None or not hasattr(model, "embed_inputs"):
        model_type = getattr(model, "model_type", type(model).__name__)
        raise ValueError(
            f"target model type '{model_type}' does not take images: mlx-lm takes them for "
            f"{', '.join(PROCESSORS)} models with a vision_config"
        )
    images = [read_image(Path(f)) for f in files]
    try:
        text, pixel_values = processor(prompt, images=images)
    except ValueError as exc:  # mlx-lm's count of placeholders against images
        raise ValueError(
            f"{exc} Put one {processor.image_token} in the prompt where each image goes."
        ) from None
    if templated:
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = encode_prompt(tokenizer, text)
    rows = model.embed_inputs(mx.array(ids), pixel_values=pixel_values)
    mx.eval(rows)
    return ids, rows


def read_image(path: Path) -> np.ndarray:
    """The image file at `path` as (height, width, 3) uint8 RGB, as mlx_lm.generate reads it."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ValueError(
            "reading images takes Pillow, as mlx-lm's does: pip install pillow"
        ) from None
    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {path}")
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{path} is not an image PIL can read: {exc}") from None
