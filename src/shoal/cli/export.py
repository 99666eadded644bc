"""`shoal export`: a checkpoint's model weights out of shoal (one file, or a Hugging Face
model directory), loadable without shoal."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="a checkpoint's weights as one safetensors/torch file or an HF model",
        description="Write the model weights of CHECKPOINT (a step_N folder, or a "
        "checkpoint_dir: its newest complete checkpoint), whatever the strategy that saved "
        "it, as full tensors keyed as the model's state_dict.")
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument("out", metavar="OUT", help="the file to write (under hf: a directory)")
    parser.add_argument("--format", default="safetensors",
                        choices=["safetensors", "torch", "hf"],
                        help="safetensors (default), torch (torch.save of the state_dict), "
                        "or hf: the run's transformers model as a save_pretrained directory")
    parser.set_defaults(handler=export_command)


def export_command(args: argparse.Namespace) -> int:
    from shoal.checkpoint.export import export
    from shoal.checkpoint.store import CheckpointError

    try:
        path = export(args.checkpoint, args.out, args.format)
    except CheckpointError as exc:
        print(f"shoal export: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"shoal: exported the model of {path} to {args.out} ({args.format})",
          file=sys.stderr, flush=True)
    return 0
