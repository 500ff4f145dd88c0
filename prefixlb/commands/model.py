"""``prefixlb model``: save a preset as a Hugging Face checkpoint, or describe a model.

    prefixlb model save tiny DIR      # DIR/config.json + model.safetensors (transformers loads it)
    prefixlb model save tiny DIR --seed 7   # another model of the tiny shape
    prefixlb model info tiny|small|DIR
"""
from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixlb model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    save = sub.add_parser("save", help="write a preset (tiny, small) as a Hugging Face checkpoint")
    save.add_argument("preset", help="preset name: tiny or small")
    save.add_argument("directory", help="output directory (created if missing)")
    save.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    save.add_argument("--seed", type=int, default=None,
                      help="draw the weights from this seed instead of the preset's (another model of the same "
                           "shape, e.g. the two stages of a test cascade)")
    info = sub.add_parser("info", help="print a model's configuration and parameter count")
    info.add_argument("model", help="preset name or checkpoint directory")
    return parser


def main(argv: list[str]) -> int:
    """Run ``prefixlb model save|info``; 0 on success, 2 on a bad model name or directory."""
    args = _parser().parse_args(argv)
    from worker.engine.errors import ModelLoadError
    from worker.engine.model.loader import load_model_config, torch_dtype
    from worker.engine.model.presets import PRESETS, build_preset
    from worker.engine.model.save import save_pretrained

    try:
        if args.action == "save":
            if args.preset not in PRESETS:
                raise ModelLoadError(f"unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}")
            path = save_pretrained(build_preset(args.preset, torch_dtype(args.dtype), seed=args.seed), args.directory)
            print(f"saved preset={args.preset} dtype={args.dtype} seed={args.seed if args.seed is not None else 'preset'} "
                  f"path={path}")
        else:
            config = load_model_config(args.model)
            data = config.to_hf_dict()
            data["num_parameters"] = config.num_parameters
            data["max_model_len"] = config.max_model_len
            print(json.dumps(data, indent=2))
    except ModelLoadError as exc:
        print(f"prefixlb model: {exc}", file=sys.stderr)
        return 2
    return 0
