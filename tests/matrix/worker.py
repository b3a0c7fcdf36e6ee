"""Rank worker of the version matrix: every invariant, upstream first, in one 2-rank launch.

``python -m tests.matrix.worker OUTDIR`` as each rank (tests/launch.py starts them). Each rank
writes ``OUTDIR/rank<r>.json`` after every step (so a rank that dies still reports what it saw);
tests/matrix/test_invariants.py asserts on it.

Faults that end a process group (a rank that dies, a rank stuck in a collective) cannot share the
main world: after importing TRL once, each rank forks one child per such case *before* any process
group exists; child k of every rank forms world k on its own port (``GRPO_PATCHES_TEST_PORTS``).
The parent kills a child still alive ``HANG_BOUND`` s after its fault began (the hang, bounded)
and reports what each child saw. Forking after the imports keeps one release's session cheap
(TRL's import is most of a rank's start-up).

The kit is switched only through tests/matrix/kit.py (``enable_kit`` / ``disable_kit``, and
``kit.config_fields()`` merged into every GRPOConfig built here): nothing here imports grpo_patches,
so the same scenario runs against a patched fork (``GRPO_PATCHES_MATRIX_MODE=fork``, ranks started by
tests/fork/drive.py's ``launch`` from a scratch folder) as against the monkeypatch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback

T_IMPORT = __import__("time").time()
from tests.matrix import kit  # noqa: E402  (imports no TRL; fork mode: checks grpo_patches is absent)

ENVIRONMENT = kit.check_rank_environment()

from tests.helpers import (  # noqa: E402
    grpo_args,
    lora,
    prompt_dataset,
    quiet,
    target_share,
    tiny_policy,
    tiny_reward_model,
    tiny_tokenizer,
)

quiet()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForSequenceClassification, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
REWARD_TIMEOUT = 2.0  # the sleep children's; the kit's exchanges then time out after 2 + 15 + 0.2 s
# The main world's: its ranks drift apart under load between TRL's collectives (seen: > 17 s at a load
# average of 15 on 2 cores), and the kit's fail-fast group is created, with the exchanges' short
# timeout, inside GRPOTrainer.__init__. The faults there raise at once, so nothing waits on it.
MAIN_TIMEOUT = 120.0
# Still alive this long after its fault began: hung (the bound the kit promises). The kit fails in ~0.4 s past
# reward_timeout here; once, on a loaded 2-core machine (12+ processes), it took 5.25 s, hence 7; a kit that fell
# back on its exchanges' own timeout (2 + 15 + 0.2 s) still misses it.
HANG_BOUND = REWARD_TIMEOUT + 7.0
CHUNK = 4  # reward_chunk_size: smaller than a rank's batch (8), two groups of G=2 per call
G = 2
PBS = 8

CALLS: list[dict] = []
FAULT: dict = {"kind": None, "rank": None}
EPOCH = {"e": -1}
RM_FORWARDS: list[str] = []  # tags of reward-model forwards on this rank ("module" / "path")
RM_LOADS: list[str] = []  # reward models loaded from a path on this rank


def recording_reward(completions, row, group_ids=None, num_generations=None, **kwargs):
    """Records every call (rank, rows, group ids, epoch), scores by the target letter, and
    misbehaves on ``FAULT["rank"]`` when a fault is armed."""
    CALLS.append({"rank": RANK, "rows": list(row), "group_ids": None if group_ids is None else list(group_ids),
                  "num_generations": num_generations, "epoch": EPOCH["e"]})
    out = target_share(completions, target=kwargs.get("target"))
    if FAULT["kind"] and FAULT["rank"] == RANK:
        kind = FAULT["kind"]
        if kind == "raise":
            raise ZeroDivisionError("injected in recording_reward")
        if kind == "wronglen":
            return out[:-1]
        if kind == "nan":
            return [float("nan")] + out[1:]
        if kind == "sleep":
            time.sleep(60)
    return out


def length_reward(completions, **kwargs):
    return [len(c.split()) / 6.0 for c in completions]


class EpochMark(TrainerCallback):
    def on_epoch_begin(self, args, state, control, **kwargs):
        EPOCH["e"] += 1


def _count_forwards(module, args, output):
    tag = getattr(module, "grpo_test_tag", None)
    if isinstance(module, torch.nn.Module) and module.__class__.__name__.endswith("ForSequenceClassification"):
        RM_FORWARDS.append(tag or "path")


torch.nn.modules.module.register_module_forward_hook(_count_forwards)
_from_pretrained = AutoModelForSequenceClassification.from_pretrained


def _counting_from_pretrained(cls, *args, **kwargs):
    RM_LOADS.append(str(args[0] if args else kwargs.get("pretrained_model_name_or_path")))
    return _from_pretrained(*args, **kwargs)


AutoModelForSequenceClassification.from_pretrained = classmethod(_counting_from_pretrained)


def release_modes() -> list[dict]:
    """Every scale_rewards / aggregation setting this release's GRPOConfig has (read off the config)."""
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    modes: list[dict] = [{}]
    if "scale_rewards" in fields:
        default = fields["scale_rewards"].default
        modes = ([{"scale_rewards": v} for v in (True, False)] if isinstance(default, bool)
                 else [{"scale_rewards": v} for v in ("group", "batch", "none")])
    if "multi_objective_aggregation" in fields:
        modes.append({**modes[0], "multi_objective_aggregation": "normalize_then_sum"})
    return modes


def reward_model_dir() -> str:
    """A reward model given by path (TRL's hub-id branch, no hub): saved with save_pretrained, per rank."""
    path = os.path.join(OUTDIR, f"rm-rank{RANK}", "tiny-path-model")
    if not os.path.isdir(path):
        model = tiny_reward_model(seed=3, name="tiny-path-model")
        model.save_pretrained(path)  # before any process group: transformers saves on the main process only
        tiny_tokenizer().save_pretrained(path)
    return path


def build(reward_funcs=None, n_rows=16, callbacks=None, **config):
    fields = dict(per_device_train_batch_size=PBS, num_generations=G)
    fields.update(config)
    reward_funcs = reward_funcs or [recording_reward]
    kwargs = {}
    if any(isinstance(f, str | torch.nn.Module) for f in reward_funcs):  # reward models: their tokenizer
        kwargs["reward_processing_classes"] = [tiny_tokenizer() if isinstance(f, str | torch.nn.Module) else None
                                               for f in reward_funcs]
    return GRPOTrainer(model=tiny_policy(), reward_funcs=reward_funcs, args=grpo_args(**kit.config_fields(), **fields),
                       train_dataset=prompt_dataset(n_rows), processing_class=tiny_tokenizer(),
                       peft_config=lora(), callbacks=callbacks, **kwargs)


def scoring_funcs():
    module = tiny_reward_model(seed=1)
    module.grpo_test_tag = "module"
    return [recording_reward, length_reward, module, reward_model_dir()]


def generate_once(trainer, seed=123):
    """One generation round through upstream's own method (0.15: _prepare_inputs)."""
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    torch.manual_seed(seed)
    generate = getattr(trainer, "_generate_and_score_completions", None) or trainer._prepare_inputs
    return batch, generate(batch)


def observe(trainer) -> dict:
    """What one generation round did: prompts, samples, advantages, reward calls, reward-model use."""
    CALLS.clear()
    RM_FORWARDS.clear()
    batch, out = generate_once(trainer)
    return {"rows": [b["row"] for b in batch], "completion_ids": out["completion_ids"].tolist(),
            "advantages": out["advantages"].tolist(), "calls": list(CALLS), "rm_forwards": list(RM_FORWARDS),
            "holds_model": [isinstance(f, torch.nn.Module) for f in trainer.reward_funcs]}


def try_fault(trainer, kind: str, bad_rank: int) -> dict:
    FAULT.update(kind=kind, rank=bad_rank)
    t0 = time.monotonic()
    try:
        generate_once(trainer)
        out = {"raised": None}
    except Exception as exc:
        out = {"raised": f"{type(exc).__name__}: {exc}", "remote": kit.is_remote_failure(exc)}
    finally:
        FAULT.update(kind=None, rank=None)
    out.update(bad_rank=bad_rank, seconds=time.monotonic() - t0)
    return out


def train_epochs(n_rows: int, epochs: int) -> dict:
    """Train ``epochs`` epochs on a dataset that leaves rows over; the rows of every reward call, by epoch."""
    EPOCH["e"] = -1
    CALLS.clear()
    trainer = build(n_rows=n_rows, per_device_train_batch_size=4, max_steps=-1, num_train_epochs=epochs,
                    callbacks=[EpochMark()])
    try:
        trainer.train()
    except AttributeError as exc:
        if not untrainable_here():
            raise
        return {"calls": list(CALLS), "untrainable": f"{type(exc).__name__}: {exc}"}
    return {"calls": list(CALLS), "steps": trainer.state.global_step}


def untrainable_here() -> bool:
    """TRL 1.15.0 computes log-probs only through a Triton kernel (``trl.trainer.utils._ChunkedLogProbFunction``
    is ``None`` where Triton is missing, as on these CPU machines), so no training step can run, stock or
    patched; 1.16 added a torch path. Generation and scoring still run."""
    import trl.trainer.utils as trl_utils

    return getattr(trl_utils, "_ChunkedLogProbFunction", "absent") is None


def class_snapshot() -> dict:
    return {cls: dict(vars(cls)) for cls in kit.declared_patch_points()} if kit.CAN_REVERT else {}


def _changed(before: dict, what: str, out: list) -> None:
    for cls, attrs in before.items():
        now = dict(vars(cls))
        for name in set(attrs) | set(now):
            if attrs.get(name, "<absent>") is not now.get(name, "<absent>"):
                out.append(f"{cls.__name__}.{name} ({what})")


def i6_checks(before: dict) -> dict:
    """After enable_kit: every declared attribute is wrapped (around the original, where the mode has
    it: ``before``); the install step again changes no attribute; after disable_kit (CAN_REVERT only):
    every attribute of every patched class is the identical object it was before (no list here)."""
    out: dict = {"declared": {}, "not_wrapped": [], "changed_by_second_apply": [], "changed_after_revert": []}
    kit.enable_kit()
    points = kit.declared_patch_points()
    for cls, names in points.items():
        out["declared"][cls.__name__] = names
        for name in names:
            got = kit.wrapped_original(cls.__dict__.get(name))
            if got is None or (kit.CAN_REVERT and got is not before[cls].get(name, getattr(cls.__mro__[1], name, None))):
                out["not_wrapped"].append(f"{cls.__name__}.{name}")
    applied = {cls: dict(vars(cls)) for cls in points}
    kit.apply_again()
    _changed(applied, "second apply", out["changed_by_second_apply"])
    kit.disable_kit()
    if kit.CAN_REVERT:
        _changed(before, "revert", out["changed_after_revert"])
    return out


# --- children: faults that end their process group ---------------------------------------------------

CHILDREN = {  # name -> (kit options or None for upstream, fault kind, bad rank)
    "upstream_raise": (None, "raise", 1),
    "upstream_wronglen": (None, "wronglen", 1),
    "upstream_sleep": (None, "sleep", 1),
    # a NaN on one rank: accepted silently by most releases, but 0.20 then runs a different sequence of
    # collectives on the two ranks (the next process group never forms): not for the main world either
    "upstream_nan": (None, "nan", 1),
    "patched_sleep_local": ({"reward_placement": "local"}, "sleep", 1),
    "patched_sleep_main": ({"reward_placement": "main"}, "sleep", 0),
}


def child_path(name: str, rank: int = RANK) -> str:
    return os.path.join(OUTDIR, f"rank{rank}-{name}.json")


def run_child(name: str, port: str) -> None:
    os.environ["MASTER_PORT"] = port
    threading.Timer(60.0, lambda: os._exit(9)).start()  # backstop if the parent is gone
    options, kind, bad_rank = CHILDREN[name]
    data: dict = {"name": name}

    def save():
        with open(child_path(name) + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(child_path(name) + ".tmp", child_path(name))

    code = 0
    try:
        if options is None:
            kit.disable_kit()
        else:
            kit.enable_kit(reward_chunk_size=CHUNK, reward_timeout=REWARD_TIMEOUT, **options)
        grpo_args()  # initializes this world's process group (accelerate), so that the ranks can line up
        if dist.is_initialized():  # before the build: it creates the kit's group with the short timeout
            dist.barrier()
        trainer = build()
        # Ranks run stock generation without a collective before the rewards: line them up, so that
        # "still running HANG_BOUND s after the fault began" means the same moment on every rank.
        if dist.is_initialized():
            dist.barrier()
        data["fault_started"] = time.time()
        save()
        data.update(try_fault(trainer, kind, bad_rank))
        data["ended"] = time.time()
        code = 3 if data["raised"] else 0
    except BaseException as exc:  # noqa: BLE001
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["traceback"] = traceback.format_exc()[-2000:]
        code = 4
    save()
    os._exit(code)


def start_children() -> dict[str, int]:
    ports = os.environ.get("GRPO_PATCHES_TEST_PORTS", "").split(",")
    assert len(ports) >= len(CHILDREN), "tests/launch.py run_ranks(extra_ports=...) must give one port per child"
    pids = {}
    for name, port in zip(CHILDREN, ports, strict=False):
        pid = os.fork()
        if pid == 0:
            try:
                run_child(name, port)
            finally:  # a child never returns into the parent's code
                traceback.print_exc()
                os._exit(5)
        pids[name] = pid
    return pids


def read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def reap_children(pids: dict[str, int], start: float) -> dict:
    out = {}
    pending = dict(pids)
    while pending:
        for name, pid in list(pending.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            seen = read_json(child_path(name))
            if done:
                # Stuck past the bound, then ended by its peer's death (each rank's parent kills its own
                # child; one kill can come first): that child hung too.
                stuck = seen.get("ended", 0) - seen.get("fault_started", time.time()) > HANG_BOUND
                out[name] = {**seen, "returncode": os.waitstatus_to_exitcode(status), "hung": stuck}
                del pending[name]
                continue
            began = seen.get("fault_started")
            if (began and time.time() - began > HANG_BOUND) or time.time() - start > 150:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                out[name] = {**seen, "returncode": None, "hung": True, "killed_after": time.time() - (began or start)}
                del pending[name]
        time.sleep(0.1)
    return out


# --- the main world ---------------------------------------------------------------------------------

def scenario(data: dict, save) -> None:
    modes = release_modes()
    data["modes"] = modes
    before = class_snapshot()

    # I1 upstream: 2 completions per rank with num_generations=4 -> every group split over both ranks.
    kit.disable_kit()
    split = dict(per_device_train_batch_size=2, num_generations=4)
    data["stock_split"] = observe(build(**split))["calls"]
    save()
    # I2 upstream: 6 rows, 4 prompts per generation round (2 ranks x 4 completions / G=2), 3 epochs.
    data["stock_epochs"] = train_epochs(6, 3)
    save()
    # I3 / I4 upstream, every mode: reward functions and both reward-model branches on every rank.
    RM_LOADS.clear()
    data["stock"] = [observe(build(scoring_funcs(), **mode)) for mode in modes]
    data["stock_loads"] = list(RM_LOADS)
    save()

    # I4: a chunk size that would cut a group is refused at construction, with the nearest valid values
    kit.enable_kit(reward_chunk_size=CHUNK + 1)
    try:
        build()
        data["chunk_refusal"] = None
    except ValueError as exc:
        data["chunk_refusal"] = str(exc)
    for placement in ("local", "main"):
        kit.enable_kit(reward_placement=placement, reward_chunk_size=CHUNK, reward_timeout=MAIN_TIMEOUT)
        got: dict = {}
        try:  # I1: the same split shape, refused at construction
            build(**split)
            got["refusal"] = None
        except kit.SHAPE_ERRORS as exc:
            got["refusal"] = str(exc)
        RM_LOADS.clear()
        trainers = [build(scoring_funcs(), **mode) for mode in modes]
        got["modes"] = [observe(t) for t in trainers]
        got["loads"] = list(RM_LOADS)
        trainer = trainers[0]  # the release's default mode
        # I5 in the same world: each fault on the rank that scores (local: rank 1; main: rank 0 only scores)
        bad = 1 if placement == "local" else 0
        got["faults"] = {kind: try_fault(trainer, kind, bad) for kind in ("raise", "wronglen", "nan")}
        got["after_faults"] = observe(trainer)["advantages"]  # the world is still usable
        # I4 unequal per-rank counts, where upstream has a reward method to call (0.19+)
        if hasattr(GRPOTrainer, "_calculate_rewards"):
            got["unequal"] = unequal_counts(trainer)
        data[placement] = got
        save()

    # I3 with the kit's default settings (no options): stock's samples and advantages where groups do not split
    kit.enable_kit()
    data["default"] = observe(build(scoring_funcs(), **modes[0]))
    save()
    # lean_lora: every LoRA layer of the policy hooked where peft has the cast switch (>= 0.15), else refused
    data["lean"] = lean_lora_check()
    save()
    # I2 patched
    data["patched_epochs"] = train_epochs(6, 3)
    save()
    # I6
    data["i6"] = i6_checks(before)
    kit.disable_kit()
    data["wrapt_imported"] = "wrapt" in sys.modules  # fork mode: the patched fork must not need it


def lean_lora_check() -> dict:
    import importlib.metadata

    out: dict = {"peft": importlib.metadata.version("peft")}
    try:
        kit.enable_kit(lean_lora=True)  # monkeypatch mode: refused here; fork mode: when the trainer is built
        trainer = build()
    except ValueError as exc:
        out["refusal"] = str(exc)
        return out
    finally:
        kit.enable_kit()
    layers = [m for m in trainer.model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
    out["lora_layers"] = len(layers)
    out["switched"] = sum(bool(getattr(m, "_grpo_lean_lora", False)) for m in layers)
    return out


def unequal_counts(trainer) -> dict:
    """Rank r scores 4 * (r + 1) completions (unequal per-rank counts) through upstream's reward
    method; TRL's caller reads rank r's rows at ``r * n`` (its ``process_slice``)."""
    n = 4 * (RANK + 1)
    completions = [" ".join(["a"] * (1 + (RANK + i) % 3) + ["b"]) for i in range(n)]
    inputs = [{"prompt": "say the letter a please", "row": 100 * RANK + i // G, "target": "a"} for i in range(n)]
    CALLS.clear()
    trainer.model.train()
    rewards = trainer._calculate_rewards(inputs, [x["prompt"] for x in inputs], completions, [[0]] * n)
    own = rewards[RANK * n:(RANK + 1) * n, 0].cpu()
    return {"own": own.tolist(), "expected": target_share(completions, target=["a"] * n), "calls": list(CALLS)}


def main() -> None:
    global OUTDIR
    OUTDIR = sys.argv[1]
    start = time.time()
    print(f"worker: imports done {start - T_IMPORT:.1f} s", file=sys.stderr, flush=True)
    reward_model_dir()
    pids = start_children()
    import trl

    data: dict = {"rank": RANK, "world": WORLD, "trl": trl.__version__, **ENVIRONMENT}

    def save():
        data.setdefault("stage_ends_s", []).append(round(time.time() - start, 1))  # where the time goes
        with open(os.path.join(OUTDIR, f"rank{RANK}.json.tmp"), "w") as f:
            json.dump(data, f)
        os.replace(os.path.join(OUTDIR, f"rank{RANK}.json.tmp"), os.path.join(OUTDIR, f"rank{RANK}.json"))

    code = 0
    try:
        scenario(data, save)
    except Exception as exc:
        data["error"] = f"{type(exc).__name__}: {exc}"
        data["traceback"] = traceback.format_exc()[-3000:]
        code = 3
    data["main_seconds"] = time.time() - start
    save()
    data["children"] = reap_children(pids, start)
    data["seconds"] = time.time() - start
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    print(f"worker: scenario ended after {data['seconds']:.1f} s", file=sys.stderr, flush=True)
    if code == 0 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    print(f"worker: exit after {time.time() - start:.1f} s", file=sys.stderr, flush=True)
    os._exit(code)  # torch 2.13 + gloo can abort or hang at interpreter exit


OUTDIR = tempfile.gettempdir()

if __name__ == "__main__":
    main()
