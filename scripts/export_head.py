"""Re-save an EAGLE3 head in another dtype (e.g. bf16 to ship it), in the published layout.

python scripts/export_head.py runs/eagle3-smollm2/head assets/eagle3-smollm2-135m-instruct --dtype bfloat16
"""

from __future__ import annotations

import argparse

from hsmc.eagle.checkpoint import load_eagle3_head, save_eagle3_head
from hsmc.models.loading import DTYPES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("destination")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    args = parser.parse_args()
    head, config = load_eagle3_head(args.source)
    folder = save_eagle3_head(head, config, args.destination, DTYPES[args.dtype])
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
