"""Checks before any process of a run starts: each bad input is one line naming the key, file and
line, within seconds (no warm start, no model weights loaded). The launcher runs them first."""

from __future__ import annotations

import functools

from tidal.config import TidalConfig
from tidal.data import Dataset, DatasetError, Problem, load_dataset, prompt_encoder
from tidal.rewards import check_reward_names


def check_before_start(cfg: TidalConfig, dataset: Dataset | None = None) -> Dataset:
    """Reward names (user modules imported in a sandboxed process), the environment and its tools, data files, row sizes,
    prompt lengths against the context; the dataset, loaded once for the launcher (or the one it passed).
    A hub model with the hub out of reach: its cached copy, offline, or one line saying it cannot be had."""
    from tidal.model.hub import check_hub_model

    check_hub_model(cfg.model.name_or_path)
    check_reward_names(cfg.reward)
    check_environment(cfg)
    dataset = dataset if dataset is not None else load_dataset(cfg.data, cfg.seed)
    check_row_sizes(dataset, cfg.transport.max_payload_mb)
    check_agent_renders_images(cfg, dataset)
    check_prompt_lengths(cfg, dataset)
    return dataset


def check_agent_renders_images(cfg: TidalConfig, dataset: Dataset) -> None:
    """rollout.agent with rows that have images: the model's chat template renders each image part of a first user
    message as the image token (a template that drops them would stop the first worker that met such a row), and
    rollout.partial is off (a trajectory with images is not yet prefilled again under new weights)."""
    row = next((p for p in (*dataset.train, *dataset.eval) if p.images), None) if cfg.rollout.agent is not None else None
    if row is None:
        return
    if cfg.rollout.partial:
        raise DatasetError(
            f"{where(row)}: the row has images, and rollout.partial does not yet continue a multi-turn trajectory with images "
            "under new weights (single-turn rows with images, or rollout.partial: false)"
        )
    from tidal.model.vision import IMAGE_TOKEN

    tokenizer = prompt_tokenizer(cfg)
    if not getattr(tokenizer, "chat_template", None):
        return  # the agent loop's own check says so, in one line
    image_token = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    parts = [{"type": "image"}] * len(row.images) + [{"type": "text", "text": row.prompt.strip()}]
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as err:  # noqa: BLE001 - a template's own error, of any type: the user needs one line
        raise DatasetError(
            f"{where(row)}: the model's chat template cannot render the row's images in a user message ({type(err).__name__}: {err})"
        ) from None
    rendered = list(ids).count(image_token) if image_token is not None and image_token != tokenizer.unk_token_id else 0
    if rendered != len(row.images):
        raise DatasetError(
            f"{where(row)}: the row has {len(row.images)} image(s), and the model's chat template renders {rendered} {IMAGE_TOKEN} tokens "
            "for them; rollout.agent needs a template that renders a user message's image parts"
        )


def check_environment(cfg: TidalConfig) -> None:
    """rollout.agent's env, tools and tool_parser resolve, every tool has a schema, and one
    environment can be built: an EnvError naming the one that does not. The tools' modules and a
    user's environment class are imported in sandboxed processes, as a worker's are, never here."""
    a = cfg.rollout.agent
    if a is None:
        return
    from tidal.envs import EnvironmentFactory

    EnvironmentFactory.from_config(a, warm=False).close()


def where(problem: Problem) -> str:
    return problem.origin or f"data.prompt_template (problem {problem.id})"


def check_row_sizes(dataset: Dataset, max_payload_mb: int) -> None:
    """A problem travels in one work item, which must fit in one NATS message."""
    limit = max_payload_mb * 2**20
    for p in (*dataset.train, *dataset.eval):
        size = len(p.prompt.encode(errors="surrogateescape")) + len(p.answer.encode(errors="surrogateescape")) + sum(map(len, p.images))
        if size > limit:
            raise DatasetError(
                f"{where(p)}: the row is {size / 2**20:.1f} MB; a work item must fit in transport.max_payload_mb ({max_payload_mb} MB)"
            )


def model_context(cfg: TidalConfig) -> tuple[int | None, str]:
    """(tokens a prompt and its response may take, the key that sets it); None when the model does not say."""
    if cfg.model.name_or_path is None:
        return cfg.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    from transformers import AutoConfig

    from tidal.model.loading import _loading

    with _loading(cfg.model.name_or_path, "config"):
        context = getattr(AutoConfig.from_pretrained(cfg.model.name_or_path), "max_position_embeddings", None)
    key = f"the max_position_embeddings of model.name_or_path {cfg.model.name_or_path}"
    vllm_len = cfg.rollout.vllm.max_model_len if cfg.rollout.engine == "vllm" else None
    if vllm_len is not None and (context is None or vllm_len < context):
        return vllm_len, "rollout.vllm.max_model_len"
    return context, key


def prompt_tokenizer(cfg: TidalConfig):
    if cfg.model.name_or_path is None:
        from tidal.model.base_model import tiny_tokenizer

        return tiny_tokenizer(cfg.model.tiny.arch)
    return tokenizer_of(cfg.model.name_or_path)


@functools.lru_cache(maxsize=2)
def tokenizer_of(path: str):
    """A model's tokenizer, loaded once per process: the launcher checks prompts against it before the
    warm start (model.name_or_path) and after it (the base model, the same path when nothing warm-starts)."""
    from tidal.model.loading import load_tokenizer

    return load_tokenizer(path)


def check_prompt_lengths(cfg: TidalConfig, dataset: Dataset) -> None:
    """Every prompt, as the model sees it, plus its longest response fits the model's context."""
    context, key = model_context(cfg)
    if context is None:
        return
    new_tokens = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)
    encode = prompt_encoder(prompt_tokenizer(cfg), cfg.data)
    for p in (*dataset.train, *dataset.eval):
        n = len(encode(p.prompt))
        if n + new_tokens > context:
            raise DatasetError(
                f"{where(p)}: the prompt is {n} tokens; with up to {new_tokens} new tokens (rollout.max_new_tokens, eval.max_new_tokens) "
                f"it does not fit the model's context of {context} tokens ({key})"
            )


def check_this_machine(cfg: TidalConfig) -> None:
    """What `tidal run` runs on this machine exists here: vLLM for a vLLM engine (rollout.engine or
    eval.engine), the accelerator trainer.device / trainer.reference_device name, and FlexAttention
    for trainer.attention 'flex'. Local runs only:
    a pipeline's pods are built from other images, on other nodes."""
    import importlib.util

    engines = [
        key for key, kind in (("rollout.engine", cfg.rollout.engine), ("eval.engine", cfg.eval.engine if cfg.eval.enabled else "")) if kind == "vllm"
    ]
    if engines and importlib.util.find_spec("vllm") is None:
        from tidal.rollout.vllm_args import INSTALL_HINT

        raise ValueError(f"{' and '.join(engines)} is 'vllm' but vllm is not installed in this environment: {INSTALL_HINT}")
    for key, requested in (("trainer.device", cfg.trainer.device), ("trainer.reference_device", cfg.trainer.reference_device)):
        if requested not in (None, "auto", "cpu"):
            from tidal.devices import resolve_device

            resolve_device(requested, key)
    if cfg.trainer.attention == "flex":
        from tidal.devices import resolve_device
        from tidal.trainer.packing import flex_attention_supported

        device = resolve_device(cfg.trainer.device)
        if not flex_attention_supported(device):
            raise ValueError(
                f"trainer.attention 'flex' trains on CUDA only, and the trainer's device here is {device!r} "
                "(FlexAttention has no backward pass there): use 'auto', 'segmented' or 'sdpa'"
            )
