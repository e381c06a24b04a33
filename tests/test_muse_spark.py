"""muse_spark, the family whose mlx-lm model runs fused Metal kernels (`mlx_lm/kernels`): a tiny
random config with mlx-lm's own kernel bodies run on the CPU by the MSL emulator (tests/msl_emu),
greedy DFlash output equal to mlx-lm's token for token, every rollback depth lossless, trees
refused in one line; with its vision tower, `generate --image`'s reply equal to mlx_lm.generate
--image's."""

import importlib
import json
import os

import helpers
import mlx.core as mx
import msl_emu
import numpy as np
import pytest
import test_families as families
from helpers import reference_greedy
from mlx.utils import tree_flatten
from mlx_lm.generate import generate as mlx_lm_generate
from mlx_lm.models import muse_spark
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.processors import load_processor
from mlx_lm.utils import load as mlx_lm_load
from test_families import PROMPT, NoisyOracleDraft, first_difference, run
from test_generate import OracleDraft

import dflash_mlx
from dflash_mlx import cli, stream_generate
from dflash_mlx.models import target as target_module
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.rollback import WindowKVCache
from dflash_mlx.models.target import TargetAdapter

RUNS_METAL_KERNELS = target_module.runs_metal_kernels  # before the fixture stands in for it

NO_COMPILER = "no clang with _Float16/__bf16 (apt-get install clang-19 libclang-rt-19-dev)"
# Skipped on a developer's machine without clang; under CI=true they run, and fail.
pytestmark = pytest.mark.skipif(
    msl_emu.find_compiler() is None and os.environ.get("CI") != "true", reason=NO_COMPILER
)

KERNELS = [
    "expert_routing",
    "norm_add_norm",
    "post_expert_norm_combine",
    "qk_norm",
    "qk_norm_rope",
    "rms_norm_sigmoid_gate",
]
SLIDING, FULL = "sliding_attention", "full_attention"
TEXT = dict(  # sliding (window 8, RoPE) and global (NoPE) layers, MoE in every layer
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    vocab_size=families.VOCAB,
    rms_norm_eps=1e-6,
    post_norm_eps=1e-6,
    rope_parameters={"rope_theta": 50000.0},
    layer_rope_theta=[50000.0, 0.0, 50000.0],
    layer_types=[SLIDING, FULL, SLIDING],
    sliding_window=8,
    final_logit_softcapping=30.0,
    output_multiplier=1.0,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_hidden_size=32,
    moe_intermediate_size=48,
)
KERNEL_FAMILIES = {"muse_spark": (muse_spark, dict(text_config=TEXT))}
MAX_TOKENS = 24  # each kernel call is a process: ~0.3 s a forward


@pytest.fixture(scope="module")
def emulated_kernels():
    """mlx-lm's Metal kernels made by the emulator's `metal_kernel` (the modules reloaded with
    it, so that the model's imported functions call emulated kernels), put back afterwards."""
    modules = [importlib.import_module(f"mlx_lm.kernels.{name}") for name in KERNELS]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mx.fast, "metal_kernel", msl_emu.metal_kernel)
        patch.setattr(target_module, "runs_metal_kernels", lambda model: False)  # emulated
        for module in modules:
            importlib.reload(module)
        yield
    for module in modules:
        importlib.reload(module)


@pytest.fixture(scope="module")
def spark(emulated_kernels):
    """(model, random 2-layer drafter, mlx-lm's greedy continuation of PROMPT: MAX_TOKENS
    tokens and 16 more, for an oracle drafter's last block)."""
    model = families.build("muse_spark", families=KERNEL_FAMILIES)
    draft = init_draft(model, num_layers=2, block_size=16)
    continuation = reference_greedy(model, PROMPT, MAX_TOKENS + 16, set())
    assert len(set(continuation)) > MAX_TOKENS // 3, "a degenerate random model proves little"
    return model, draft, continuation


tokenizer = families.tokenizer  # its fixture, shared


def test_greedy_equals_mlx_lm(spark, tokenizer):
    """Block 16 with a random drafter (block 4 and every rollback depth: the test below)."""
    model, draft, continuation = spark
    expected = continuation[:MAX_TOKENS]
    tokens, responses = run(model, draft, tokenizer, PROMPT, block_size=16, max_tokens=MAX_TOKENS)
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert sum(r.accepted for r in responses) < sum(r.proposed for r in responses)


def test_oracle_is_fully_accepted_and_every_rollback_depth_is_lossless(spark, tokenizer):
    model, draft, continuation = spark
    expected = continuation[:MAX_TOKENS]
    oracle = OracleDraft(draft, PROMPT + continuation)
    tokens, responses = run(model, oracle, tokenizer, PROMPT, block_size=16, max_tokens=MAX_TOKENS)
    assert tokens == expected
    assert all(r.accepted == r.proposed for r in responses)

    noisy = NoisyOracleDraft(draft, PROMPT + continuation)
    tokens, responses = run(model, noisy, tokenizer, PROMPT, block_size=4, max_tokens=MAX_TOKENS)
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert {r.accepted for r in responses[1:-1]} == set(range(4))


def test_caches_are_replaced_the_head_found_and_embeddings_normalised(spark):
    model, draft, _ = spark
    target = TargetAdapter(model)
    native = model.make_cache()
    assert [type(c) for c in target.make_cache()] == [
        WindowKVCache if type(c) is RotatingKVCache else KVCache for c in native
    ]
    assert target.head is model.lm_head
    ids = mx.array([[5, 9, 33]])
    assert mx.array_equal(target.embed_tokens(ids), model.model.language_model.embed(ids))


def test_trees_are_refused_in_one_line(spark, tokenizer):
    model, draft, _ = spark
    with pytest.raises(ValueError, match="'muse_spark'.*rotates queries and keys in a fused"):
        next(stream_generate(model, draft, tokenizer, PROMPT, tree_budget=4))


VISION = dict(  # 4x4-pixel patches merged 2x2; an 8x8 position table, so an image wider than
    hidden_size=32,  # 8 patches attends in windows in its window-attention layer
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    patch_size=4,
    merge_size=2,
    pos_emb_height=8,
    pos_emb_width=8,
)
IMAGE_TOKENS = ["<|image_start|>", "<|patch|>", "<|image_end|>"]  # mlx-lm's processor's
IMAGE_PROMPT = "Look: <|patch|> What is it?"
IMAGE_REPLY_TOKENS = 12


@pytest.fixture(scope="module")
def vision_model(emulated_kernels, tmp_path_factory):
    """(target dir, drafter dir, image file): a tiny random muse_spark with its vision tower
    and the test tokenizer with the image tokens, float32 (as dflash-mlx loads it on a CPU),
    a random 2-layer drafter, and a 40x80 random PNG (5x10 image tokens: resized to fit)."""
    from PIL import Image
    from tokenizers import AddedToken, Tokenizer

    path = tmp_path_factory.mktemp("muse-spark-vision")
    helpers.build_tokenizer(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in IMAGE_TOKENS])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "model_type": "muse_spark",
        "text_config": TEXT,
        "vision_config": VISION,
        "image_token_id": tokenizer.token_to_id("<|patch|>"),
        # read by transformers' MuseSparkConfig (loaded with the tokenizer), which checks them
        "audio_config": {"out_hidden_size": TEXT["hidden_size"]},
        "eos_token_id": 1,
        "bos_token_id": 0,
    }
    config["text_config"] = dict(TEXT, eos_token_id=1, bos_token_id=0)
    model = families.build("muse_spark", families={"muse_spark": (muse_spark, config)})
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    draft = helpers.save_draft(path.with_name("drafter"), TEXT, target_layer_ids=[0, 2])
    pixels = np.random.default_rng(0).integers(0, 256, size=(40, 80, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path / "image.png")
    return path, draft, path / "image.png"


def mlx_lm_image_reply(
    path, prompt: str, image, max_tokens: int, rows: bool = True, templated: bool = False
) -> str:
    """mlx_lm.generate --image's reply (greedy), by the functions its main calls, to the raw
    prompt or (`templated`) to it as a user turn of the chat template; without `rows`, the
    image's placeholders run as tokens instead of its rows."""
    from PIL import Image

    model, tokenizer, config = mlx_lm_load(str(path), return_config=True)
    if templated:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [np.asarray(Image.open(image).convert("RGB"))]
    prompt, pixel_values = load_processor(model, config)(prompt, images=images)
    ids = tokenizer.encode(prompt, add_special_tokens=not templated)
    embeddings = None
    if rows:
        embeddings = model.embed_inputs(mx.array(ids), pixel_values=pixel_values)
        mx.eval(embeddings)
    reply = mlx_lm_generate(
        model, tokenizer, ids, max_tokens=max_tokens, input_embeddings=embeddings
    )
    return reply


def test_an_image_prompt_equals_mlx_lm_generate_image(vision_model, capsys):
    """Raw and (the default) as a user turn of the chat template, which writes the special
    tokens it wants: mlx-lm adds none to it."""
    path, draft, image = vision_model
    argv = ["generate", "--model", str(path), "--draft", str(draft), "-p", IMAGE_PROMPT]
    argv += ["--image", str(image), "--verbose", "False", "-m", str(IMAGE_REPLY_TOKENS)]
    argv += ["--block-size", "4"]
    cli.main([*argv, "--ignore-chat-template"])
    reply = capsys.readouterr().out
    expected = mlx_lm_image_reply(path, IMAGE_PROMPT, image, IMAGE_REPLY_TOKENS)
    assert reply == expected + "\n"
    # the image's rows made the reply: its placeholders run as tokens give another
    assert mlx_lm_image_reply(path, IMAGE_PROMPT, image, IMAGE_REPLY_TOKENS, rows=False) != expected
    cli.main(argv)
    templated = mlx_lm_image_reply(path, IMAGE_PROMPT, image, IMAGE_REPLY_TOKENS, templated=True)
    assert capsys.readouterr().out == templated + "\n"


def test_an_image_for_a_model_without_images_or_placeholder_is_refused_in_one_line(
    vision_model, make_pair, capsys
):
    path, draft, image = vision_model
    text_target, text_draft = make_pair("llama-tied-gqa")
    cases = [
        (text_target, text_draft, IMAGE_PROMPT, "target model type 'llama' does not take images"),
        (path, draft, "no placeholder", "The text has 0 <|patch|> for 1 images. Put one"),
    ]
    for target, drafter, prompt, message in cases:
        argv = ["generate", "--model", str(target), "--draft", str(drafter), "-p", prompt]
        with pytest.raises(SystemExit):
            cli.main([*argv, "--image", str(image), "--verbose", "False"])
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


@pytest.mark.skipif(mx.metal.is_available(), reason="Metal runs mlx-lm's kernels here")
def test_without_metal_a_target_of_mlx_lm_kernels_is_refused_in_one_line(vision_model, loaded):
    path, _, _ = vision_model
    with pytest.MonkeyPatch.context() as patch:  # the real check, not the fixture's stand-in
        patch.setattr(target_module, "runs_metal_kernels", RUNS_METAL_KERNELS)
        with pytest.raises(ValueError, match="^target model type 'muse_spark' runs mlx-lm's fused"):
            dflash_mlx.load(path)
    assert not RUNS_METAL_KERNELS(loaded("llama-tied-gqa")[0])
