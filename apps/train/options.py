"""Everything a ``polyaccel train`` run needs, checked before any rank is spawned.

:func:`options_from_args` turns parsed CLI arguments into a frozen :class:`TrainOptions` or
raises :class:`polyaccel.ConfigError` naming the bad flag and the fix. The ranks receive the
options object as is (it pickles), so the parent and the ranks can never disagree.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from polyaccel.config_check import Float, Int, OneOf, check_flag
from polyaccel.errors import ConfigError

from .kernels import resolve as resolve_kernels
from .kernels import section as kernels_section
from .model import ModelSpec
from .sequence import check_sp

#: models whose feed-forward layers are experts (AutoEP places them; ``--ep``)
MOE_MODELS = ("mixtral",)

DTYPES = ("fp32", "bf16", "fp16")
#: ``--optimizer``: AdamW everywhere, or Muon for the hidden matrices with AdamW (``--adam-lr``) for the rest
OPTIMIZERS = ("adamw", "muon")
#: ``--lr`` when not given, per optimizer (Muon's orthogonalized update wants a larger step)
DEFAULT_LR = {"adamw": 3e-3, "muon": 0.02}
STAGES = (1, 2, 3)
#: ``--lr`` and ``--adam-lr``
_LR = Float(0.0, above=True)
#: file (in the save directory) that maps a checkpoint tag to the run that wrote it
META_PREFIX = "train-meta-"


@dataclass(frozen=True)
class TrainOptions:
    model: ModelSpec = field(default_factory=ModelSpec)
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 64
    grad_accum: int = 1
    lr: float = 3e-3
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    adam_lr: float = 3e-3  # --optimizer muon: the lr of the parameters Muon leaves to AdamW
    grad_clip: float = 1.0
    stage: int = 2
    offload: bool = False
    #: --offload at stage 1/2: the host's share of the optimizer (the rest stays on the device)
    offload_ratio: float = 1.0
    #: the gradient buckets' size in elements when a partial offload needs several (None: the engine's default)
    bucket_size: int | None = None
    tp: int = 1  # tensor-parallel degree: ranks = data x tensor
    ep: int = 1  # expert-parallel degree (MoE models): experts over ep ranks, carved out of data
    sp: int = 1  # sequence-parallel degree (AutoSP): each sequence over sp ranks; ranks = data x sequence x tensor
    #: MoE models: the routed experts replayed from device graphs: True, False or "auto" (AutoEP's default)
    capture_graphs: bool | str = "auto"
    #: --kernels resolved: auto / all / off (apps/train/kernels.py)
    kernels: str = "off"
    dtype: str = "fp32"
    seed: int = 1234
    nproc: int = 2
    threads: int = 1
    accelerator: str | None = None
    text: str | None = None
    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    resume_tag: str | None = None
    init_from: str | None = None  # a plain HF safetensors state dict: the weights the run starts from
    start_step: int = 0  # filled from the checkpoint on --resume
    log_every: int = 10
    metrics_out: str | None = None

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data (the ranks of one tensor or sequence group share their batch)."""
        return self.nproc // (self.tp * self.sp)

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step over all ranks."""
        return self.data_parallel * self.batch_size * self.seq_len * self.grad_accum

    def engine_config(self) -> dict:
        """The DeepSpeed-style config dict handed to ``polyaccel.initialize``."""
        zero: dict = {"stage": self.stage}
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
            if self.stage == 3:
                zero["offload_param"] = {"device": "cpu"}
            if self.offload_ratio != 1:
                zero["offload_optimizer"]["ratio"] = self.offload_ratio
        if self.bucket_size is not None:
            zero["reduce_bucket_size"] = self.bucket_size
        cfg: dict = {
            "train_micro_batch_size_per_gpu": self.batch_size,
            "zero_optimization": zero,
            "gradient_accumulation_steps": self.grad_accum,
            "gradient_clipping": self.grad_clip,
            "optimizer": {"type": "AdamW", "params": {
                "lr": self.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": self.weight_decay}},
        }
        if self.optimizer == "muon":  # the same AdamW settings for the embeddings, head, norms and biases
            cfg["optimizer"] = {"type": "muon", "params": {
                "lr": self.lr, "weight_decay": self.weight_decay, "adam_lr": self.adam_lr,
                "adam_betas": [0.9, 0.95], "adam_eps": 1e-8, "adam_weight_decay": self.weight_decay}}
        if self.tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": self.tp}
        if self.sp > 1:
            cfg["sequence_parallel"] = {"autosp_size": self.sp, "seq_dim": 1}
        if self.model.name in MOE_MODELS:  # AutoEP runs the experts (grouped_mm), at ep 1 too
            cfg["expert_parallel"] = {"autoep_size": self.ep}
            if self.capture_graphs != "auto":
                cfg["expert_parallel"]["capture_graphs"] = self.capture_graphs
        if self.kernels != "off":
            cfg["kernels"] = kernels_section(self.kernels)
        if self.dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif self.dtype == "fp16":
            cfg["fp16"] = {"enabled": True}
        return cfg

    def as_dict(self) -> dict:
        return asdict(self)


def _positive(flag: str, value, minimum=1) -> None:
    check_flag(flag, value, Int(minimum))


def read_checkpoint_meta(directory: str, tag: str | None) -> tuple[str, dict]:
    """(tag, metadata) of the checkpoint ``tag`` (default: the one named by ``latest``) in ``directory``.

    The metadata file must match its checksum (see :mod:`polyaccel.safe_files`); a damaged,
    empty or missing file is a :class:`ConfigError` naming it.
    """
    from polyaccel.engines.zero import complete_tags, read_latest
    from polyaccel.errors import CheckpointError
    from polyaccel.safe_files import read_checked_json

    d = Path(directory)
    if not d.is_dir():
        raise ConfigError(f"--resume {directory}: no such directory; pass a directory written by --save")
    if tag is None:
        if not (d / "latest").is_file():
            raise ConfigError(
                f"--resume {directory}: no 'latest' file, so it holds no complete checkpoint; "
                "pass a directory written by `polyaccel train --save`"
            )
        try:
            tag = read_latest(d)
        except CheckpointError as exc:
            raise ConfigError(f"--resume {directory}: {exc} (--resume-tag)") from None
    meta_file = d / f"{META_PREFIX}{tag}.json"
    if not meta_file.is_file():
        tags = [t for t in complete_tags(d) if (d / f"{META_PREFIX}{t}.json").is_file()]
        raise ConfigError(
            f"--resume {directory}: checkpoint {tag!r} has no {meta_file.name}, so it was not written by "
            "`polyaccel train --save` (or the save did not finish); pick another --resume-tag or directory"
            f" ({'saved by polyaccel train here: ' + ', '.join(tags) if tags else 'none here was'})"
        )
    fix = "restore it from a good copy, or pick another --resume-tag"
    try:
        meta, checked = read_checked_json(meta_file, fix)
    except CheckpointError as exc:
        raise ConfigError(f"--resume {directory}: {exc}") from None
    if not checked:
        raise ConfigError(
            f"--resume {directory}: {meta_file} has no checksum (written by an older polyaccel), so it cannot be "
            f"verified; convert the checkpoint with `polyaccel zero-to-fp32 --no-verify {directory} model.safetensors`"
            " and start from it with --init-from model.safetensors")
    if not isinstance(meta.get("step"), int) or not isinstance(meta.get("model"), dict):
        raise ConfigError(f"--resume {directory}: {meta_file} lacks 'step' or 'model'; it was not written by "
                          f"`polyaccel train --save`; {fix}")
    return tag, meta


def write_checkpoint_meta(directory: str, tag: str, meta: dict) -> Path:
    """Write the run metadata for ``tag`` atomically (temporary name, fsync, rename), with its checksum."""
    from polyaccel.safe_files import write_checked_json

    return write_checked_json(Path(directory) / f"{META_PREFIX}{tag}.json", meta)


def options_from_args(args, accelerator) -> TrainOptions:
    """Validate parsed arguments against each other and the selected accelerator."""
    spec = ModelSpec(name=args.model, hidden_size=args.hidden_size, num_layers=args.layers,
                     num_heads=args.heads, max_positions=max(256, args.seq_len)).validate()
    optimizer = check_flag("--optimizer", getattr(args, "optimizer", "adamw"), OneOf(OPTIMIZERS))
    dtype = check_flag("--dtype", args.dtype, OneOf(DTYPES))
    lr = args.lr if getattr(args, "lr", None) is not None else DEFAULT_LR.get(optimizer, DEFAULT_LR["adamw"])
    adam_lr = getattr(args, "adam_lr", None)
    if adam_lr is None:
        adam_lr = DEFAULT_LR["adamw"]
    _check_hyperparameters(args, lr)
    _check_optimizer(optimizer, adam_lr, args)
    _check_dtype(dtype, accelerator)
    _check_checkpoint_flags(args)
    nproc = _nproc(args.nproc, accelerator)
    tp = getattr(args, "tp", 1)
    ep = getattr(args, "ep", 1)
    _check_tp(tp, nproc, spec)
    sp = getattr(args, "sp", 1)
    check_sp(sp, nproc, tp, args.seq_len, spec.num_heads, spec)
    _check_ep(ep, nproc, tp, spec, sp)
    _check_plans(tp, ep, spec)
    capture_graphs = {"true": True, "false": False}.get(getattr(args, "capture_graphs", "auto"), "auto")
    _check_capture_graphs(capture_graphs, spec, ep, args.stage, accelerator)
    offload_ratio = getattr(args, "offload_ratio", 1.0)
    _check_offload_ratio(offload_ratio, args, optimizer, tp)
    bucket_size = partial_offload_bucket_size(spec) if offload_ratio != 1 else None
    init_from = _init_from(args, spec)
    # the ranks share the host's cores: for the model itself on cpu, for the offloaded optimizer on a device
    threads = args.threads or max(1, _cpu_count() // nproc)
    _positive("--threads", threads)
    _check_text(args)
    _check_save_dir(args.save)
    resume_tag, start_step = _resume_point(args, spec)
    _check_metrics_out(args.metrics_out)
    kernels = resolve_kernels(getattr(args, "kernels", None), accelerator)
    log_every = args.log_every if args.log_every else max(1, args.steps // 10)
    _positive("--log-every", log_every)
    return TrainOptions(
        model=spec, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
        lr=lr, weight_decay=args.weight_decay, optimizer=optimizer, adam_lr=adam_lr, grad_clip=args.grad_clip,
        stage=args.stage,
        offload=args.offload, offload_ratio=offload_ratio, bucket_size=bucket_size, tp=tp, ep=ep, sp=sp,
        capture_graphs=capture_graphs, dtype=dtype, seed=args.seed,
        nproc=nproc, threads=threads,
        accelerator=accelerator.name, text=args.text, save=args.save, save_every=args.save_every,
        resume=args.resume, resume_tag=resume_tag, init_from=init_from, start_step=start_step, log_every=log_every,
        metrics_out=args.metrics_out, kernels=kernels,
    )


def _check_hyperparameters(args, lr: float) -> None:
    """Step counts, sizes, optimizer numbers and the ZeRO stage."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--grad-accum", args.grad_accum)):
        _positive(flag, value)
    _positive("--seq-len", args.seq_len, 2)
    if args.seq_len > 8192:
        raise ConfigError(f"--seq-len {args.seq_len}: at most 8192 for this small model")
    check_flag("--lr", lr, _LR, "(e.g. 3e-3)")
    check_flag("--weight-decay", args.weight_decay, Float(0.0))
    check_flag("--grad-clip", args.grad_clip, Float(0.0), "(0 turns clipping off)")
    check_flag("--stage", args.stage, OneOf(STAGES))


def _check_optimizer(optimizer: str, adam_lr: float, args) -> None:
    check_flag("--adam-lr", adam_lr, _LR, "(e.g. 3e-3)")
    if optimizer != "muon" and getattr(args, "adam_lr", None) is not None:
        raise ConfigError("--adam-lr is the lr of the parameters Muon leaves to AdamW: it needs --optimizer muon "
                          "(with AdamW, --lr sets every parameter's)")


def _check_dtype(dtype: str, accelerator) -> None:
    if dtype == "bf16" and not accelerator.is_bf16_supported():
        raise ConfigError(f"--dtype bf16: accelerator {accelerator.name!r} does not support bfloat16; use fp32")
    if dtype == "fp16" and not accelerator.is_fp16_supported():
        raise ConfigError(f"--dtype fp16: accelerator {accelerator.name!r} does not support float16; use fp32")


def _check_checkpoint_flags(args) -> None:
    """The save/resume flags that need one another."""
    check_flag("--save-every", args.save_every, Int(0), "(0: save only at the end)")
    if args.save_every and not args.save:
        raise ConfigError("--save-every needs --save DIR (where to write the checkpoints)")
    if args.resume_tag and not args.resume:
        raise ConfigError("--resume-tag needs --resume DIR")


def _init_from(args, spec: ModelSpec) -> str | None:
    """The resolved ``--init-from`` file (None without the flag); a resumed run cannot take one."""
    init_from = getattr(args, "init_from", None)
    if not init_from:
        return init_from
    if args.resume:
        raise ConfigError(f"--init-from {init_from} with --resume {args.resume}: a resumed run takes its weights "
                          "from the checkpoint; pass one of them")
    return str(resolve_init_from(init_from, spec))


def _check_text(args) -> None:
    """The training text loads and holds at least one batch."""
    from .data import ByteTokenizer, TokenSampler, load_text

    tokens = ByteTokenizer().encode(load_text(args.text))
    TokenSampler(tokens, args.seq_len, args.batch_size, args.seed)  # raises on a text too short


def _check_save_dir(save_dir: str | None) -> None:
    if not save_dir:
        return
    save = Path(save_dir)
    if save.exists() and not save.is_dir():
        raise ConfigError(f"--save {save_dir}: exists and is not a directory")
    if not save.exists() and not save.parent.resolve().is_dir():
        raise ConfigError(f"--save {save_dir}: parent directory {save.parent} does not exist")


def _resume_point(args, spec: ModelSpec) -> tuple[str | None, int]:
    """(checkpoint tag, its step) for ``--resume``, after checking it holds this model and is before ``--steps``."""
    if not args.resume:
        return None, 0
    tag, meta = read_checkpoint_meta(args.resume, args.resume_tag)
    saved_spec = ModelSpec(**meta["model"])
    if saved_spec != spec:
        diff = {k: (v, getattr(spec, k)) for k, v in saved_spec.as_dict().items() if getattr(spec, k) != v}
        raise ConfigError(
            f"--resume {args.resume}: checkpoint {tag!r} holds a different model "
            f"({', '.join(f'{k}: saved {a}, asked {b}' for k, (a, b) in diff.items())}); "
            "pass the same --model/--hidden-size/--layers/--heads/--seq-len as the saved run"
        )
    start_step = int(meta["step"])
    if start_step >= args.steps:
        raise ConfigError(
            f"--steps {args.steps}: checkpoint {tag!r} in {args.resume} is already at step {start_step}; "
            f"pass --steps greater than {start_step} to continue training"
        )
    from .run_records import check_records_agree

    check_records_agree(args.resume, tag, meta)  # the folder and the metadata file come from one save
    return tag, start_step


def _check_metrics_out(path: str | None) -> None:
    if not path:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"--metrics-out {path}: directory {parent} does not exist")


def _check_tp(tp: int, nproc: int, spec: ModelSpec) -> None:
    """``--tp`` divides the ranks."""
    _positive("--tp", tp)
    if nproc % tp:
        raise ConfigError(f"--tp {tp} does not divide the {nproc} ranks (ranks = data x tensor); "
                          f"use a --tp among {[d for d in range(1, nproc + 1) if nproc % d == 0]} or change --nproc")


def _check_ep(ep: int, nproc: int, tp: int, spec: ModelSpec, sp: int = 1) -> None:
    """``--ep`` divides the data-parallel ranks (what ``--tp`` and ``--sp`` leave) on a model with experts."""
    _positive("--ep", ep)
    if spec.name not in MOE_MODELS:
        if ep > 1:
            raise ConfigError(f"--ep {ep}: model {spec.name!r} has no experts; use --model "
                              f"{' or '.join(MOE_MODELS)} for expert parallelism")
        return
    data = nproc // (tp * sp)
    if data % ep:
        what = f"{nproc} ranks" + (f" / --tp {tp}" if tp > 1 else "") + (f" / --sp {sp}" if sp > 1 else "")
        raise ConfigError(f"--ep {ep} does not divide the {data} data-parallel ranks ({what}; experts are spread "
                          f"over ep ranks carved out of data); use an --ep among "
                          f"{[d for d in range(1, data + 1) if data % d == 0]} or change --nproc/--tp")


def _check_capture_graphs(capture_graphs: bool | str, spec: ModelSpec, ep: int, stage: int, accelerator) -> None:
    """``--capture-graphs true`` where AutoEP can replay its experts: a MoE model at ep 1, ZeRO stage 1 or 2 (stage 3
    gathers the experts in hooks a replay would skip), an accelerator with device graphs. ``auto`` and ``false``
    are never refused (auto runs eagerly where graphs cannot serve)."""
    if capture_graphs is not True:
        return
    if spec.name not in MOE_MODELS:
        raise ConfigError(f"--capture-graphs replays the experts of a MoE layer; model {spec.name!r} has none: use "
                          f"--model {' or '.join(MOE_MODELS)}")
    if ep > 1:
        raise ConfigError(f"--capture-graphs needs --ep 1 (got {ep}): a device graph fixes the rows each expert rank "
                          "receives, which the all-to-all changes every step")
    if stage == 3:
        raise ConfigError("--capture-graphs needs --stage 1 or 2: stage 3 gathers the experts' parameters in module "
                          "hooks, which a graph replay would skip")
    if not accelerator.has("graphs"):
        raise ConfigError(f"--capture-graphs: accelerator {accelerator.name!r} has no device graphs; drop the flag "
                          "(or pick an accelerator with graphs, e.g. --accelerator cuda)")


def _check_offload_ratio(ratio: float, args, optimizer: str, tp: int) -> None:
    """``--offload-ratio`` where the engine can split the optimizer between host and device."""
    if ratio == 1:
        return
    check_flag("--offload-ratio", ratio, Float(0.0, 1.0, above=True),
               "(the share of the optimizer stepped on the host, e.g. 0.5)")
    if not args.offload:
        raise ConfigError(f"--offload-ratio {ratio} needs --offload (it splits the offloaded optimizer)")
    if args.stage == 3:
        raise ConfigError(f"--offload-ratio {ratio} needs --stage 1 or 2 (with --stage 3, --offload moves the "
                          "parameters to the host too, and those are not split)")
    if optimizer != "adamw":
        raise ConfigError(f"--offload-ratio {ratio} needs --optimizer adamw (Muon steps whole matrices)")
    if tp > 1:
        raise ConfigError(f"--offload-ratio {ratio} needs --tp 1 (parameters replicated over tensor ranks are "
                          "summed over the whole partition)")


#: gradient buckets per rank's partition when a partial offload splits it (the split falls between buckets)
PARTIAL_OFFLOAD_BUCKETS = 20


def partial_offload_bucket_size(spec: ModelSpec) -> int:
    """A bucket size giving each rank's partition about :data:`PARTIAL_OFFLOAD_BUCKETS` buckets, so an
    ``--offload-ratio`` lands within a few percent (the model counted on the meta device)."""
    import torch

    from .model import build_model

    with torch.device("meta"):
        n = sum(p.numel() for p in build_model(spec).parameters())
    return max(1, n // PARTIAL_OFFLOAD_BUCKETS)


def _check_plans(tp: int, ep: int, spec: ModelSpec) -> None:
    """The model takes the degrees: AutoEP's detection at ``ep`` (experts divisible), then AutoTP's plan at
    ``tp`` on the model AutoEP left (its experts placed, so AutoTP leaves them whole), on the meta device."""
    moe = spec.name in MOE_MODELS
    if tp == 1 and not moe:
        return
    import torch

    from .model import build_model

    with torch.device("meta"):
        model = build_model(spec)
    if moe:
        from polyaccel.engines.autoep import apply_autoep, detect, parse_config

        try:
            detect(model, parse_config({"autoep_size": ep}))
        except ConfigError as exc:
            raise ConfigError(f"--ep {ep}: {exc}") from None
        if tp > 1:
            apply_autoep(model, {"autoep_size": 1})  # the layout AutoTP sees; the expert degree does not change it
    if tp > 1:
        from polyaccel.engines.autotp import infer_plan

        try:
            infer_plan(model, tp)
        except ConfigError as exc:
            raise ConfigError(f"--tp {tp}: {exc}") from None


def resolve_init_from(path: str, spec: ModelSpec) -> Path:
    """The safetensors file ``--init-from`` names (a file, or a directory holding ``model.safetensors``), checked
    against the model ``spec`` builds: the same names and shapes (tied weights may be left out, as Hugging Face
    saves them), without reading the tensors."""
    p = Path(path)
    if p.is_dir():
        p = p / "model.safetensors"
    if not p.is_file():
        raise ConfigError(f"--init-from {path}: no such file; pass a safetensors state dict (a file, or a "
                          "directory with model.safetensors), e.g. what `polyaccel zero-to-fp32` writes")
    problems = _init_from_problems(*_safetensors_header(path, p), spec)
    if problems:
        raise ConfigError(f"--init-from {path}: does not fit the {spec.name} model of --hidden-size "
                          f"{spec.hidden_size} --layers {spec.num_layers} --heads {spec.num_heads} "
                          f"({'; '.join(problems)}); pass the flags the state dict was made with")
    return p


def _safetensors_header(path: str, p: Path) -> tuple[dict, dict]:
    """(name -> shape, name -> dtype code) of the safetensors file ``p``, read from its header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
            codes = {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix
        raise ConfigError(f"--init-from {path}: not a readable safetensors file ({exc})") from None
    return shapes, codes


def _init_from_problems(shapes: dict, codes: dict, spec: ModelSpec) -> list[str]:
    """What keeps a state dict of these ``shapes`` and dtype ``codes`` from loading into ``spec``'s model."""
    import torch

    from .model import build_model

    with torch.device("meta"):
        model = build_model(spec)
    state = model.state_dict()
    want = {k: tuple(v.shape) for k, v in state.items()}
    tied = _tied_names(model)
    found = (
        ("missing", [k for k in want if k not in shapes and k not in tied]),
        ("not in the model", list(set(shapes) - set(want))),
        ("shape", [f"{k} {list(shapes[k])} (the model has {list(want[k])})" for k in want
                   if k in shapes and shapes[k] != want[k]]),
        ("dtype", _dtype_mismatches(state, codes)),
    )
    return [f"{what}: {', '.join(sorted(names)[:4])}{' ...' if len(names) > 4 else ''}"
            for what, names in found if names]


def _dtype_mismatches(state: dict, codes: dict) -> list[str]:
    """The tensors whose saved dtype code is floating where the model's is not, or the other way round."""
    out = []
    for k, v in state.items():
        floating = v.is_floating_point()
        if k in codes and codes[k].startswith(("F", "BF")) != floating:
            out.append(f"{k} {codes[k]} (the model's is {'floating' if floating else 'not floating'})")
    return out


def _tied_names(model) -> set[str]:
    """The parameter names that repeat an earlier parameter (tied weights, which Hugging Face leaves out)."""
    first: dict[int, str] = {}
    tied = set()
    for name, prm in model.named_parameters(remove_duplicate=False):
        if id(prm) in first:
            tied.add(name)
        first.setdefault(id(prm), name)
    return tied


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: host ranks allowed per available core (cpu plugin); every rank is a process with its own pipes and threads
CPU_RANKS_PER_CORE = 4
#: host ranks always allowed, however few cores there are (small tests oversubscribe on purpose)
MIN_CPU_RANK_LIMIT = 16


def max_cpu_ranks() -> int:
    """How many ranks ``--nproc`` may start on the host: a small multiple of the cores this process may use."""
    return max(MIN_CPU_RANK_LIMIT, CPU_RANKS_PER_CORE * _cpu_count())


def _nproc(requested: int | None, accelerator) -> int:
    if accelerator.device_type == "cpu":
        n = 2 if requested is None else requested
        _positive("--nproc", n)
        limit = max_cpu_ranks()
        if n > limit:
            raise ConfigError(
                f"--nproc {n}: at most {limit} ranks on the host ({CPU_RANKS_PER_CORE} per available core, "
                f"{_cpu_count()} core(s), at least {MIN_CPU_RANK_LIMIT}); use --nproc {limit} or less"
            )
        return n
    count = accelerator.device_count()
    if requested is None:
        if count < 1:
            raise ConfigError(f"accelerator {accelerator.name!r} reports no devices; pass --accelerator cpu")
        return count
    _positive("--nproc", requested)
    if requested > count:
        raise ConfigError(
            f"--nproc {requested}: accelerator {accelerator.name!r} has only {count} device(s); "
            f"use --nproc {count} or less"
        )
    return requested
