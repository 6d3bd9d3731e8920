"""``python -m torchtitan_autoparallel.calibrate``: measure this cluster, save a cost profile.

Launch it like training, one process per device, so it measures the links
training will use:

    CALIBRATE=1 NGPU=4 ./run_train.sh --out profile.json
    python -m torch.distributed.run --standalone --nproc-per-node 4 -m torchtitan_autoparallel.calibrate --out profile.json

then plan with ``--autoparallel.cost_profile profile.json``. Beside the
profile, ``<out>.samples.json`` keeps every timing and the fits' residuals.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from torchtitan_autoparallel.calibrate import measure, measure_step
from torchtitan_autoparallel.calibrate.fit import FitError, build_profile, fit_compute, fit_link, fit_step, kept_from_base
from torchtitan_autoparallel.calibrate.measure import KIB, check_mesh_shape, default_settings, intra_node_dims, note
from torchtitan_autoparallel.errors import UserError
from torchtitan_autoparallel.mesh.runtime import exit_process, init_runtime, shutdown
from torchtitan_autoparallel.planner.cost.profiles import default_profile_name, load_profile
from torchtitan_autoparallel.train.failures import USER_ERROR_EXIT, record_user_error


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise UserError(f"{message}; accepted: see python -m torchtitan_autoparallel.calibrate --help")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be >= 1")
    return values


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m torchtitan_autoparallel.calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="calibrated_profile.json", help="where to write the profile JSON")
    p.add_argument("--name", default="calibrated", help="the profile's name")
    p.add_argument("--base", default="auto", help="profile whose unmeasured fields are kept (default: the device's)")
    p.add_argument("--mesh-shape", default="", help="e.g. 2x4 (default: nodes x devices per node)")
    p.add_argument("--matmul-sizes", type=_sizes, help="n of the n x n matmuls, comma-separated")
    p.add_argument("--copy-kib", type=_sizes, help="copy sizes in KiB")
    p.add_argument("--message-kib", type=_sizes, help="collective sizes in KiB (the full buffer)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per measurement")
    return p


def _settings(args: argparse.Namespace, device_type: str):

    s = default_settings(device_type)
    if args.repeats is not None and args.repeats < 1:
        raise UserError(f"--repeats {args.repeats}; accepted: an integer >= 1")
    return replace(
        s,
        matmul_sizes=args.matmul_sizes or s.matmul_sizes,
        copy_bytes=tuple(k * KIB for k in args.copy_kib) if args.copy_kib else s.copy_bytes,
        message_bytes=tuple(k * KIB for k in args.message_kib) if args.message_kib else s.message_bytes,
        repeats=args.repeats or s.repeats,
    )


def _mesh_shape(text: str, world: int, local: int) -> tuple[int, ...]:

    if text:
        try:
            shape = tuple(int(v) for v in text.lower().split("x"))
        except ValueError:
            raise UserError(f"--mesh-shape {text!r}; accepted: sizes joined by 'x', e.g. 2x4") from None
    else:
        shape = (world // local, local) if world > local and world % local == 0 else (world,)
    check_mesh_shape(shape, world)
    return shape


def _base_profile(name: str, device_type: str):
    import torch


    try:
        gpu = torch.cuda.get_device_name() if device_type == "cuda" else ""
        return load_profile(default_profile_name(device_type, False, gpu) if name == "auto" else name)
    except ValueError as e:
        raise UserError(f"--base: {e}") from None


def calibrate(args: argparse.Namespace, runtime) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh


    settings = _settings(args, runtime.device_type)
    step_settings = measure_step.default_step_settings()
    base = _base_profile(args.base, runtime.device_type)
    world = runtime.world_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    shape = _mesh_shape(args.mesh_shape, world, local)
    # One node: every mesh dim is intra-node, whatever size a later plan's mesh has.
    devices_per_node = local if world > local else max(local, base.devices_per_node)
    pairs = measure.pair_dims(shape, world, devices_per_node)
    show = runtime.rank == 0
    measure.note(f"{world} rank(s) on {runtime.device_type}, mesh {'x'.join(map(str, shape))}, "
                 f"{settings.repeats} repeats per measurement", show)
    total = settings.steps + measure.comm_steps(shape, settings, pairs) + step_settings.steps
    progress = measure.Progress(total, show)
    compute = measure.measure_compute(settings, runtime.device, progress)
    memory_gib = measure.device_memory_gib(runtime.device)
    host = measure_step.measure_host(step_settings, runtime.device, settings.repeats, progress, settings.window_s)
    names = tuple(f"dim{i}" for i in range(len(shape)))
    mesh = init_device_mesh(runtime.device_type, shape, mesh_dim_names=names)
    optimizer = measure_step.measure_optimizer(step_settings, mesh, runtime.device, settings.repeats, progress)
    comm, pair_comm = [], []
    if world > 1:
        comm = measure.measure_comm(mesh, settings, runtime.device, progress)
    if pairs:  # groups of two adjacent ranks: on one node, intra-node like every dim here
        pair_mesh = init_device_mesh(runtime.device_type, (world // 2, 2), mesh_dim_names=("pair_outer", "pair"))
        pair_comm = measure.measure_comm(pair_mesh, settings, runtime.device, progress, dims=(1,))
    if show:
        measured = Measured(compute, comm, pair_comm, host, optimizer, memory_gib)
        _fit_and_save(args, base, measured, shape, devices_per_node)
    dist.barrier()


@dataclass(frozen=True)
class Measured:
    compute: list
    comm: list  # over the mesh's dims
    pair_comm: list  # over groups of two ranks, all intra-node
    host: list
    optimizer: list
    device_memory_gib: float | None = None  # None: not measured (CPU)


def _fit_and_save(args, base, m: Measured, shape, devices_per_node) -> None:

    intra_dims = intra_node_dims(shape, devices_per_node)
    intra = [s for s in m.comm if intra_dims[s.mesh_dim]] + m.pair_comm
    inter = [s for s in m.comm if not intra_dims[s.mesh_dim]]
    compute_fit = fit_compute(m.compute)
    intra_fit = fit_link(intra) if intra else None
    inter_fit = fit_link(inter) if inter else None
    step_fit = fit_step(m.host, m.optimizer, compute_fit.mem_bandwidth_GBps)
    profile = build_profile(args.name, base, compute_fit, intra_fit, inter_fit, devices_per_node, step_fit,
                            m.device_memory_gib)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.to_json(out)
    kept = kept_from_base(intra_fit, inter_fit, m.device_memory_gib)
    sidecar = {
        "profile": profile.to_dict(),
        "mesh_shape": list(shape),
        "fit_rel_rms": {"compute": compute_fit.rel_rms, "intra_node": intra_fit and intra_fit.rel_rms,
                        "inter_node": inter_fit and inter_fit.rel_rms, **step_fit.rel_rms},
        "kept_from_base": {"profile": base.name, "fields": kept},
        "compute_samples": [asdict(s) for s in m.compute],
        "comm_samples": [asdict(s) for s in m.comm],
        "pair_comm_samples": [asdict(s) for s in m.pair_comm],
        "host_samples": [asdict(s) for s in m.host],
        "optimizer_samples": [asdict(s) for s in m.optimizer],
    }
    out.with_suffix(".samples.json").write_text(json.dumps(sidecar, indent=1) + "\n")
    _report(profile, compute_fit, intra_fit, inter_fit, step_fit, kept, base, out)


def _report(profile, compute_fit, intra_fit, inter_fit, step_fit, kept, base, out: Path) -> None:

    peaks = ", ".join(f"{d} {v:.4g}" for d, v in profile.peak_tflops.items())
    note(f"compute: {peaks} TFLOP/s; memory {profile.mem_bandwidth_GBps:.4g} GB/s; "
         f"launch {profile.kernel_overhead_us:.3g} us (fit error {100 * compute_fit.rel_rms:.1f}% rms)", True)
    for label, fit in (("intra-node", intra_fit), ("inter-node", inter_fit)):
        if fit is not None:
            note(f"{label} link: latency {fit.link.latency_us:.3g} us, bandwidth {fit.link.bandwidth_GBps:.4g} GB/s, "
                 f"{fit.link.call_overhead_us:.4g} us per call (fit error {100 * fit.rel_rms:.1f}% rms)", True)
    note(f"host: {step_fit.host_us_per_node:.3g} us per graph node, {step_fit.alloc_us_per_byte * 4096:.3g} us per "
         f"fresh 4 KiB page of output (fit error {100 * step_fit.rel_rms['host']:.1f}% rms)", True)
    note(f"optimizer (clip + AdamW): {step_fit.optimizer_us_per_tensor:.4g} us per tensor, "
         f"{step_fit.optimizer_us_per_element * 1e3:.3g} ns per local element, {step_fit.optimizer_fixed_us:.4g} us "
         f"per step (fit error {100 * step_fit.rel_rms['optimizer']:.1f}% rms)", True)
    if "device_memory_gib" not in kept:
        note(f"device memory: {profile.device_memory_gib:.4g} GiB (the smallest rank's, from torch.cuda)", True)
    if kept:
        note(f"not measured here, kept from profile {base.name!r}: {', '.join(kept)}", True)
    note(f"profile written to {out}; use it with --autoparallel.cost_profile {out}", True)


def main(argv: list[str] | None = None) -> int:

    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        calibrate(args, init_runtime())
        return 0
    except (UserError, FitError) as e:
        record_user_error(str(e))  # printed once, by the launcher when it started us
        return USER_ERROR_EXIT
    finally:
        shutdown()


if __name__ == "__main__":

    exit_process(main())
