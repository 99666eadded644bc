"""`shoal k8s`: print Kubernetes manifests that train a run config on N pods."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from shoal.clusters.jobscripts import K8S_KINDS

    parser = subparsers.add_parser(
        "k8s",
        help="print Kubernetes manifests for a run config",
        description="Print YAML for kubectl apply: a ConfigMap holding RUN.yaml, and a "
        "Kubeflow PyTorchJob (--kind pytorchjob) or, for clusters without Kubeflow, a "
        "headless Service and an Indexed Job (--kind indexed-job). Each pod runs `shoal "
        "train`, which reads its node rank and the master from the pod's environment.",
    )
    parser.add_argument("--config", required=True, metavar="RUN.yaml", help="the run config")
    parser.add_argument("--name", required=True,
                        help="job name: a-z, 0-9 and '-', starting with a letter")
    parser.add_argument("--nodes", type=int, required=True, help="number of pods")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="P",
                        help="workers per pod (default: --gpus-per-node, else 1)")
    parser.add_argument("--image", default="shoal:latest",
                        help="container image with shoal installed (default shoal:latest)")
    parser.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                        help="GPUs per pod (default 0)")
    parser.add_argument("--kind", default="pytorchjob", choices=K8S_KINDS,
                        help="pytorchjob (default), indexed-job, or all (both, to compare)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides passed on to `shoal train`")
    parser.set_defaults(handler=k8s_command, command="k8s")
    return parser


def k8s_command(args: argparse.Namespace) -> int:
    from shoal.clusters.jobscripts import CONFIG_KEY, K8sJob, k8s_manifests
    from shoal.config.loader import load_run_config
    from shoal.errors import UsageError

    load_run_config(args.config, args.overrides)  # refused here, not in the pods
    try:
        text = Path(args.config).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read config {args.config}: {exc}") from None
    name = Path(args.config).name
    job = K8sJob(
        name=args.name, config_text=text, nodes=args.nodes,
        config_name=name if CONFIG_KEY.fullmatch(name) else "run.yaml",
        overrides=list(args.overrides),
        nproc_per_node=(args.nproc_per_node if args.nproc_per_node is not None
                        else args.gpus_per_node or 1),
        gpus_per_node=args.gpus_per_node, image=args.image, kind=args.kind,
    )
    sys.stdout.write(k8s_manifests(job))
    return 0
