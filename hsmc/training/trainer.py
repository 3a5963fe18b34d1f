"""`hsmc train-eagle`: regenerate the verifier's responses, build the draft vocabulary, train an
EAGLE3 head with the training-time-test loss on accelerate, checkpoint and resume, export.

Data: prompts -> the verifier's own responses (hsmc generate, chat template) -> token sequences and
response masks, cached in `output_dir/data.pt` with the settings they were made with (a rerun with other
settings is refused rather than trained on stale responses). Features and target logits come from a second
verifier pass inside each training step (storing full-vocabulary logits would not fit on disk).
The batch of step s is a function of (seed, s), so a resumed run continues exactly where it left: each
checkpoint records the settings of its run (TRAINING_FIELDS), and a rerun with others is refused rather than
mixing two runs' optimizer, schedule or batches. That includes `steps`: the cosine schedule spans it, so a
longer run is a fresh one (delete the checkpoints; data.pt is reused), not a resumed one.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from hsmc.config import load_structured
from hsmc.eagle.checkpoint import capture_layers, head_from_config, new_head_config, save_eagle3_head
from hsmc.eagle.head import Eagle3Head
from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.engine.runner import ModelRunner
from hsmc.errors import ConfigError
from hsmc.levels.base import padded_prompts
from hsmc.models.loading import DTYPES, LoadedModel, load_model, read_hf_config, resolve_folder
from hsmc.ops.backend import TorchBackend
from hsmc.prompts import Prompt, read_prompts_file
from hsmc.training.ttt import TTTBatch, ttt_loss
from hsmc.training.vocab import build_vocab_mapping

log = logging.getLogger(__name__)


@dataclass
class TrainEagleConfig:
    verifier: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    prompts_file: str | None = None  # a .jsonl file; `prompt_field` of each line is a prompt
    dataset: str | None = None  # or a `datasets` dataset: a hub name, or a loader such as "json"
    dataset_files: str | None = None  # data_files for a loader dataset ("json" + a local file)
    dataset_split: str = "train"
    prompt_field: str = "question"
    num_prompts: int = 256
    max_new_tokens: int = 128
    temperature: float = 0.0  # the verifier's sampling temperature for the responses (0 = greedy)
    chat_template: bool = True
    draft_vocab_size: int = 4096
    steps: int = 200
    batch_size: int = 4
    lr: float = 1e-4
    warmup_steps: int = 10
    ttt_steps: int = 7
    grad_clip: float = 0.5
    checkpoint_every: int = 50
    keep_checkpoints: int = 2  # the newest n checkpoint-<step> folders stay; older ones are deleted
    output_dir: str = "runs/eagle3"
    seed: int = 0
    generation_batch: int = 16
    export_dtype: str = "float32"  # the exported head's weights: float32, bfloat16 (as heads are published), float16


# the fields that decide the verifier's responses: data.pt records them, so a rerun that changed one cannot train
# on the old responses (batch sizes and the training fields leave the responses as they are)
GENERATION_FIELDS = (
    "verifier", "dtype", "prompts_file", "dataset", "dataset_files", "dataset_split", "prompt_field", "num_prompts",
    "max_new_tokens", "temperature", "chat_template", "seed",
)  # fmt: skip

# the fields a resumed run must share with its checkpoint: the responses its batches come from, the head's shape,
# the optimizer, the schedule (`steps` included: the cosine decay spans it) and the batches of each step; each
# checkpoint records them in RUN_RECORD (not checkpoint_every, keep_checkpoints, generation_batch, export_dtype)
TRAINING_FIELDS = (
    *GENERATION_FIELDS, "draft_vocab_size", "steps", "batch_size", "lr", "warmup_steps", "ttt_steps", "grad_clip",
)  # fmt: skip
RUN_RECORD = "hsmc_run.json"


def load_train_config(source: str | Path | dict, overrides: list[str] | tuple[str, ...] = ()) -> TrainEagleConfig:
    """The validated config; a missing prompts file fails here, before anything is loaded."""
    cfg = load_structured(TrainEagleConfig, source, overrides)
    if cfg.prompts_file is None and cfg.dataset is None:
        raise ConfigError("train-eagle: set prompts_file (a .jsonl) or dataset")
    if cfg.prompts_file is not None and not Path(cfg.prompts_file).is_file():
        raise ConfigError(f"train-eagle: prompts_file: no such file {cfg.prompts_file}")
    positive = (
        "num_prompts", "max_new_tokens", "draft_vocab_size", "steps", "batch_size", "lr", "ttt_steps", "grad_clip",
        "checkpoint_every", "keep_checkpoints", "generation_batch",
    )  # fmt: skip
    for key in positive:
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"train-eagle: {key} must be positive, got {getattr(cfg, key)}")
    for key in ("warmup_steps", "temperature"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"train-eagle: {key} must be >= 0, got {getattr(cfg, key)}")
    if cfg.export_dtype not in DTYPES:
        raise ConfigError(f"train-eagle: export_dtype must be one of {', '.join(DTYPES)}, got {cfg.export_dtype!r}")
    return cfg


def read_prompts(cfg: TrainEagleConfig) -> list[Prompt]:
    if cfg.prompts_file is not None:
        return read_prompts_file(cfg.prompts_file, cfg.prompt_field, "train-eagle: prompts_file")[: cfg.num_prompts]
    try:
        import datasets
    except ImportError:
        raise ConfigError("train-eagle: dataset needs the `datasets` package (pip install 'hsmc[train]')") from None
    rows = list(datasets.load_dataset(cfg.dataset, data_files=cfg.dataset_files, split=cfg.dataset_split))
    if rows and cfg.prompt_field not in rows[0]:
        raise ConfigError(f"train-eagle: prompts have no field {cfg.prompt_field!r} (fields: {sorted(rows[0])})")
    return [r[cfg.prompt_field] for r in rows[: cfg.num_prompts]]


def _settings(cfg: TrainEagleConfig, fields: tuple[str, ...]) -> dict[str, Any]:
    """`cfg`'s values of `fields`, as data.pt (GENERATION_FIELDS) and each checkpoint (TRAINING_FIELDS) record them."""
    return {field: getattr(cfg, field) for field in fields}


def _check_record(path: Path, recorded: dict | None, current: dict[str, Any], made: str, fix: str) -> None:
    """Refuse `path`, made with the settings `recorded`, when one of `current` differs: a one-line ConfigError
    naming each differing key with both values, then `fix`. A file without a record (written by an older hsmc)
    cannot be checked: it is used, with a warning."""
    if recorded is None:
        log.warning(
            "train-eagle: %s records no settings (an older hsmc made it), so it cannot be checked; using it", path
        )
        return
    differ = [
        f"{key}={recorded.get(key)!r} (this run: {value!r})"
        for key, value in current.items()
        if recorded.get(key) != value
    ]
    if differ:
        raise ConfigError(f"train-eagle: {path} {made} {', '.join(differ)}; {fix}")


def _load_cached_data(path: Path, cfg: TrainEagleConfig) -> dict:
    """The cached responses at `path`, refused when they were made with other settings than `cfg`'s."""
    data = torch.load(path, weights_only=True)
    current = _settings(cfg, GENERATION_FIELDS)
    if data.get("made_with", {}).get("temperature") == 0 and cfg.temperature == 0:
        del current["seed"]  # greedy responses are the argmax: the seed draws nothing in them
    fix = "delete it and the checkpoint-* folders trained on it, or choose another output_dir"
    _check_record(path, data.get("made_with"), current, "holds responses made with", fix)
    return data


def generate_data(cfg: TrainEagleConfig, out: Path, device: torch.device) -> dict:
    """The verifier's own responses: token sequences, where each response starts, token counts, and the settings
    they were made with; cached in `out`/data.pt and reused by a rerun with the same settings."""
    path = out / "data.pt"
    if path.is_file():
        return _load_cached_data(path, cfg)
    from hsmc.decoder import HierarchicalDecoder

    prompts = read_prompts(cfg)
    # the KV pool: as much as the GPU holds (its rows then decode at once), or a CPU-sized pool
    capacity = "auto" if device.type == "cuda" else 16384
    decoder = HierarchicalDecoder.from_config(
        {
            "levels": [{"model": cfg.verifier, "dtype": cfg.dtype, "temperature": cfg.temperature}],
            "generation": {"max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed, "chat_template": cfg.chat_template},
            "engine": {"device": str(device), "max_batch_rows": cfg.generation_batch, "kv_capacity_tokens": capacity},
        }
    )
    from hsmc.models.tokenizer import encode_prompt

    # every prompt in one call: the request driver admits the next as rows and KV free up (continuous batching)
    with tqdm(total=len(prompts), desc="responses", unit="prompt") as bar:
        results = decoder.generate(prompts, on_finish=lambda i: bar.update())
    sequences, starts = [], []
    for prompt, result in zip(prompts, results):
        ids = encode_prompt(decoder.tokenizer, prompt, cfg.chat_template)
        sequences.append(ids + result.token_ids)
        starts.append(len(ids))
    counts = torch.zeros(decoder.stack.levels[0].state.runner.module.config.vocab_size, dtype=torch.int64)
    for seq, start in zip(sequences, starts):
        counts += torch.bincount(torch.tensor(seq[start:]), minlength=counts.numel())
    data = {"sequences": sequences, "starts": starts, "counts": counts, "made_with": _settings(cfg, GENERATION_FIELDS)}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


def _verifier_batch(
    verifier: LoadedModel, layers: tuple[int, ...], sequences: list[list[int]], starts: list[int]
) -> TTTBatch:
    """Second pass: features at `layers` and logits of the verifier for a padded batch (one forward)."""
    model = verifier.model
    device = model.model.embed_tokens.weight.device
    longest = max(len(s) for s in sequences)
    tables = BlockTables(SlotAllocator(len(sequences) * longest, device), len(sequences), longest)
    runner = ModelRunner(model, tables, TorchBackend(), model.config.num_layers, capture=layers)
    tokens, lengths = padded_prompts(sequences, device)
    rows = torch.arange(len(sequences), device=device)
    logits, features = runner.forward(runner.new_tokens(rows, tokens, lengths, longest))
    positions = torch.arange(longest, device=device)
    start = torch.tensor(starts, device=device)
    mask = (positions[None] + 1 >= start[:, None]) & (positions[None] + 1 < lengths[:, None])
    return TTTBatch(features, tokens, model.model.embed_tokens(tokens), logits, mask)


def init_head(config: dict, d2t: torch.Tensor, t2d: torch.Tensor, device: torch.device, seed: int) -> Eagle3Head:
    head = head_from_config(config).to_empty(device=device)
    torch.manual_seed(seed)
    for name, p in head.named_parameters():
        torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.normal_(p, std=0.02)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    head.inv_freq = torch.tensor(head.config.inv_freq, dtype=torch.float32, device=device)
    return head


class TTTObjective(torch.nn.Module):
    """The head behind a forward that returns the TTT loss, so accelerate's DDP wrapper sees the
    forward (gradients are then all-reduced across processes). It holds the head alone: the verifier's
    frozen embeddings come with the batch, so a checkpoint is the head's state, not the vocabulary's."""

    def __init__(self, head: Eagle3Head, steps: int) -> None:
        super().__init__()
        self.head, self.steps = head, steps

    def forward(self, batch: TTTBatch) -> tuple[torch.Tensor, torch.Tensor]:
        out = ttt_loss(self.head, batch, self.steps)
        return out.loss, torch.tensor(out.accuracy)


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """The `checkpoint-<step>` folders in `out`, oldest first."""
    found = [(int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := re.fullmatch(r"checkpoint-(\d+)", p.name))]
    return sorted(found)


def latest_checkpoint(out: Path) -> tuple[int, Path] | None:
    found = checkpoints(out)
    return found[-1] if found else None


def _log_from(path: Path, step: int) -> TextIO:
    """`path` (one JSON line per step) open for appending, cut to the steps up to `step`, the one resumed from (0: a
    fresh run): the steps a run logged after its newest checkpoint are trained again, and each logs once."""
    lines = path.read_text().splitlines() if path.is_file() else []
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    path.write_text("".join(f"{line}\n" for line in kept))
    return path.open("a")


def check_checkpoint(path: Path, cfg: TrainEagleConfig) -> None:
    """Refuse to resume from the checkpoint `path` when it was trained with other settings than `cfg`'s."""
    record = path / RUN_RECORD
    recorded = json.loads(record.read_text()) if record.is_file() else None
    fix = "delete the checkpoint-* folders (data.pt is kept and reused) or choose another output_dir"
    _check_record(path, recorded, _settings(cfg, TRAINING_FIELDS), "was trained with", fix)


def save_checkpoint(accelerator: Any, out: Path, step: int, cfg: TrainEagleConfig) -> Path:
    """Save the training state and the settings of `cfg` it comes from as `checkpoint-<step>`, and delete all but
    the newest `cfg.keep_checkpoints`."""
    path = out / f"checkpoint-{step}"
    accelerator.save_state(str(path), safe_serialization=False)  # the head's fused weights are views of one storage
    if accelerator.is_main_process:
        (path / RUN_RECORD).write_text(json.dumps(_settings(cfg, TRAINING_FIELDS), indent=1) + "\n")
        for _, old in checkpoints(out)[: -cfg.keep_checkpoints]:
            shutil.rmtree(old)
    return path


def train_eagle(cfg: TrainEagleConfig) -> Path:
    """Run (or resume) training; returns the exported head's folder."""
    from accelerate import Accelerator
    from transformers import get_cosine_schedule_with_warmup

    out = Path(cfg.output_dir)
    verifier_cfg = read_hf_config(resolve_folder(cfg.verifier)).to_dict()
    if cfg.draft_vocab_size > verifier_cfg["vocab_size"]:
        raise ConfigError(
            f"train-eagle: draft_vocab_size={cfg.draft_vocab_size} exceeds the verifier's vocab_size "
            f"{verifier_cfg['vocab_size']}"
        )
    accelerator = Accelerator()
    with accelerator.main_process_first():  # one process generates and caches; the others read the cache
        data = generate_data(cfg, out, accelerator.device)
    if resume := latest_checkpoint(out):  # refused before anything is loaded or trained
        check_checkpoint(resume[1], cfg)
    verifier = load_model(cfg.verifier, cfg.dtype, accelerator.device)
    d2t, t2d = build_vocab_mapping(data["counts"], cfg.draft_vocab_size)
    head_cfg = new_head_config(verifier_cfg, cfg.draft_vocab_size)
    layers = capture_layers(head_cfg, verifier.model.config.num_layers)
    head = init_head(head_cfg, d2t, t2d, accelerator.device, cfg.seed)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps)
    objective, optimizer, scheduler = accelerator.prepare(TTTObjective(head, cfg.ttt_steps), optimizer, scheduler)
    step = 0
    if resume:
        step, path = resume
        accelerator.load_state(str(path))
        accelerator.print(f"hsmc: resuming from {path} (step {step})")
    n = len(data["sequences"])
    tokens_seen, began, accuracy = 0, time.perf_counter(), []
    log = _log_from(out / "log.jsonl", step) if accelerator.is_main_process else None
    bar = tqdm(total=cfg.steps, initial=step, desc="train-eagle", disable=not accelerator.is_main_process)
    try:
        while step < cfg.steps:
            # a function of (seed, step, process): resumable, and each process of a multi-GPU run gets its own
            stream = (cfg.seed * 100003 + step) * accelerator.num_processes + accelerator.process_index
            pick = torch.randint(0, n, (cfg.batch_size,), generator=torch.Generator().manual_seed(stream))
            seqs = [data["sequences"][i] for i in pick.tolist()]
            with torch.no_grad():
                batch = _verifier_batch(verifier, layers, seqs, [data["starts"][i] for i in pick.tolist()])
            loss, top1 = objective(batch)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(head.parameters(), cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            tokens_seen += int(batch.loss_mask.sum())
            bar.update()
            accuracy = top1.tolist()
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{accuracy[0]:.2f}/{accuracy[-1]:.2f}")
            if log is not None:
                log.write(json.dumps({"step": step, "loss": loss.item(), "top1": accuracy}) + "\n")
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save_checkpoint(accelerator, out, step, cfg)
    except KeyboardInterrupt:
        path = save_checkpoint(accelerator, out, step, cfg)
        raise KeyboardInterrupt(f"saved {path}; rerun the same command to resume") from None
    finally:
        bar.close()
        if log is not None:
            log.close()
    head = accelerator.unwrap_model(objective).head
    export = save_eagle3_head(head, head_cfg, out / "head", DTYPES[cfg.export_dtype])
    # a greedy chain keeps draft k while steps 0..k all agree: 1 + sum_k prod_{j<=k} top1_j tokens per verify
    estimate = 1 + sum(torch.tensor(accuracy[: k + 1]).prod().item() for k in range(len(accuracy)))
    accelerator.print(
        f"hsmc: trained {step} steps on {tokens_seen} response tokens in {time.perf_counter() - began:.0f}s; "
        f"last step top-1 per TTT step {[round(a, 2) for a in accuracy]} "
        f"(accepted length estimate {estimate:.2f} at gamma={len(accuracy)}); head at {export}"
    )
    return export
