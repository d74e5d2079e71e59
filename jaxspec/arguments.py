"""Command-line options shared by `jaxspec generate`, `jaxspec bench` and `jaxspec train`, and their conversion to
the library's objects (`MethodOptions`, dtypes, the mesh). Imported by `jaxspec.cli` and `jaxspec.bench`, which
import nothing from each other in the other direction."""

from __future__ import annotations

import argparse
import os

from jaxspec.errors import UserError


def add_model_args(p: argparse.ArgumentParser) -> None:
    from jaxspec.loading import DEFAULT_MODEL, KNOWN_MODELS

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a known name ({', '.join(KNOWN_MODELS)}), a .gguf file or a Hugging Face folder")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weight and activation dtype (auto: float32 on CPU, bfloat16 on TPU/GPU)")


def add_layers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", choices=("auto", "stacked", "unstacked"), default=None,
                   help="on CPU, the target's layers as the stacked scan or as per-layer buffers (different speed "
                        "per machine; per-layer compiles 4-5x longer; docs/cpu-performance.md); default "
                        "$JAXSPEC_LAYERS, else auto: the layout whose decoding step is faster here, timed once and "
                        "cached (jaxspec.budget.chosen_layout)")


def add_method_args(p: argparse.ArgumentParser) -> None:
    """Options that choose and configure the decoding method (shared by generate and bench)."""
    from jaxspec.methods import METHODS

    p.add_argument("--drafter", help="learned methods (medusa, eagle*, dflash, ddtree, jetspec, spd): a drafter "
                   "folder from `jaxspec train` (eagle3 also: a Hugging Face EAGLE-3 folder), or 'untrained'; "
                   "default: the drafter shipped for the model, if any")
    p.add_argument("--draft-model", help="draft-model: a known name, .gguf file or HF folder sharing the tokenizer")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft depth per round (default per method: draft-model --budget auto, prompt-lookup 4, "
                        "early-exit 3; eagle2/eagle3: the tree depth, default the drafter's)")
    p.add_argument("--tree-nodes", type=int, default=None,
                   help="eagle2, eagle3: drafted nodes verified per round (N of the dynamic tree)")
    p.add_argument("--lookup-tokens", type=int, default=None,
                   help="eagle2, eagle3: merge a prompt-lookup chain of this many tokens into the head's tree (the "
                        "text's own repeats drafted beside the head's guesses; 0: none); default: --budget auto "
                        "chooses, with the tree")
    p.add_argument("--tree-width", type=int, default=None,
                   help="draft-model, early-exit: top-W siblings at every depth (W x depth nodes, default 1); "
                        "eagle2/eagle3: children per expanded node (top_k); ppsd/spd: the drafted token and its "
                        "W - 1 siblings travel through the stages together")
    p.add_argument("--budget", type=parse_budget, default=None,
                   help="ddtree, jetspec: drafted nodes verified per round (B); dflash: the chain length (<= block "
                        "size); or 'auto' (the default on one device): chosen per batch size from a cost model of "
                        "this device and the head's tokens per round at each budget (both measured once, cached); "
                        "eagle2/eagle3: 'auto' only (their tree by hand takes the tree options); draft-model: "
                        "'auto' only, the chain's length (by hand: --num-draft-tokens)")
    p.add_argument("--refresh-steps", type=int, default=None,
                   help="jetspec: tree-causal re-scoring forwards after the one-forward marginal tree (default 1)")
    p.add_argument("--num-stages", type=int, default=None,
                   help="ppsd, spd: pipeline stages n (must divide the target's layers; default ppsd 5, spd the "
                        "drafter's)")
    p.add_argument("--stage-devices", type=int, default=1,
                   help="ppsd, spd: devices the stages run on (shard_map over a 'stage' mesh axis; must divide n); "
                        "1 emulates the stages on one device")
    p.add_argument("--mesh", default=None,
                   help="run on a device mesh, e.g. data=4,model=2: data splits the batch rows, model the attention "
                        "heads, feed-forward width and vocabulary (tensor parallel); default one device")
    p.add_argument("--distributed", action="store_true",
                   help="multi-host (TPU pods, several GPU hosts): call jax.distributed.initialize() first; it finds "
                        "the hosts on TPU pods, SLURM and Open MPI, elsewhere set JAX_COORDINATOR_ADDRESS, "
                        "JAX_NUM_PROCESSES and JAX_PROCESS_ID; every host runs the same command and --mesh spans the "
                        "devices of all hosts")
    p.add_argument("--ngram", type=int, default=3, help="prompt-lookup: longest n-gram to match")
    p.add_argument("--exit-layer", type=int, default=None,
                   help="early-exit: number of target layers that draft (default: a quarter of them)")
    return METHODS


def method_options(args):
    from jaxspec.methods import MethodOptions

    return MethodOptions(draft_model=args.draft_model, num_draft_tokens=args.num_draft_tokens,
                         tree_width=args.tree_width, tree_nodes=args.tree_nodes,
                         lookup_tokens=getattr(args, "lookup_tokens", None), ngram=args.ngram,
                         exit_layer=args.exit_layer, drafter=args.drafter,
                         budget=getattr(args, "budget", None), refresh_steps=getattr(args, "refresh_steps", None),
                         num_stages=getattr(args, "num_stages", None), stage_devices=getattr(args, "stage_devices", 1),
                         mesh=getattr(args, "mesh", None))


def check_mesh_arg(args):
    """Refuses a bad --mesh (unknown axis, sizes that do not multiply to the device count) before any model loads.

    Returns the mesh (for loading the target straight onto it, `load_model(..., mesh=)`), None without --mesh."""
    if getattr(args, "mesh", None) is None:
        return None
    from jaxspec.sharding import make_mesh, parse_mesh

    return make_mesh(*parse_mesh(args.mesh))


def initialize_distributed(args) -> None:
    """--distributed: joins the multi-host run before anything touches the devices (a no-op when already joined)."""
    if getattr(args, "distributed", False):
        join_distributed()


def join_distributed() -> None:
    """Joins the multi-host run (`jax.distributed.initialize`) unless already joined; UserError if it cannot."""
    import jax

    if jax.distributed.is_initialized():
        return
    try:
        # TPU pods, SLURM and Open MPI describe the cluster themselves; elsewhere JAX reads JAX_COORDINATOR_ADDRESS
        # and we pass the process count and id from JAX_NUM_PROCESSES and JAX_PROCESS_ID
        counts = {key: int(os.environ[name]) for name, key in (("JAX_NUM_PROCESSES", "num_processes"),
                                                              ("JAX_PROCESS_ID", "process_id")) if name in os.environ}
        jax.distributed.initialize(**counts)
    except (ValueError, TypeError, RuntimeError) as e:
        raise UserError(f"jax.distributed.initialize() failed ({' '.join(str(e).split())}); on a "
                        "TPU pod, under SLURM or Open MPI it finds the other hosts itself; elsewhere set "
                        "JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on "
                        "every host.") from None


def parse_budget(text: str):
    """--budget: a positive integer or 'auto'."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got '{text}'")
    return value


def dtype_from_name(name: str):
    import jax.numpy as jnp

    return {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
