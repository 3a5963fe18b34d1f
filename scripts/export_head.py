"""Re-save an EAGLE3 head in another dtype (e.g. bf16 to ship it), in the published layout.

python scripts/export_head.py runs/eagle3-smollm2/head assets/eagle3-smollm2-135m-instruct --dtype bfloat16
"""

from __future__ import annotations

import argparse

from hsmc.eagle.checkpoint import load_eagle3_head, save_eagle3_head


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("destination")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    head, config = load_eagle3_head(args.source, dtype=args.dtype)
    folder = save_eagle3_head(head, {**config, "torch_dtype": args.dtype}, args.destination)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
