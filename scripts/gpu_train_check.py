"""`hsmc train-eagle` on one GPU with a tiny random verifier: data, training, checkpoints, export.

python scripts/gpu_train_check.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_tiny_model  # noqa: E402

from hsmc.eagle.checkpoint import load_eagle3_head  # noqa: E402
from hsmc.training.trainer import load_train_config, train_eagle  # noqa: E402

out, run = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "run"
verifier, prompts = out / "verifier", out / "prompts.jsonl"
if not prompts.exists():  # the first (single-process) call creates the tiny verifier and prompts
    make_tiny_model("llama", verifier, seed=6)
    gen = torch.Generator().manual_seed(0)
    lines = [json.dumps({"ids": torch.randint(3, 100, (6,), generator=gen).tolist()}) for _ in range(24)]
    prompts.write_text("\n".join(lines))
cfg = load_train_config(
    dict(
        verifier=str(verifier),
        prompts_file=str(prompts),
        prompt_field="ids",
        num_prompts=24,
        max_new_tokens=20,
        temperature=1.0,
        draft_vocab_size=64,
        steps=40,
        batch_size=6,
        lr=3e-3,
        warmup_steps=2,
        ttt_steps=3,
        checkpoint_every=20,
        output_dir=str(out / run),
    )  # fmt: skip
)
head, _ = load_eagle3_head(str(train_eagle(cfg)))
if int(os.environ.get("RANK", "0")) != 0:  # the main process writes the log
    sys.exit(0)
log = [json.loads(line) for line in (out / run / "log.jsonl").read_text().splitlines()]
print(
    f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}: steps {len(log)}, "
    f"loss {log[0]['loss']:.3f} -> {log[-1]['loss']:.3f}, top1[0] {log[0]['top1'][0]:.2f} -> {log[-1]['top1'][0]:.2f}, "
    f"checkpoints {sorted(p.name for p in (out / run).glob('checkpoint-*'))}, GPUs {torch.cuda.device_count()}"
)
