"""The Hugging Face and Lightning callbacks on tiny CPU models (random init, float32, nothing downloaded):
a plain run records its preflight and installs the hook; under torchrun (2 gloo ranks) the preflight runs in
the trainer's own process group and training goes on in it; a run that crashes in training prints the
handbook's note after the unchanged traceback and keeps the exit code. Without the framework, one clear
ImportError names the extra to install."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

# The models and the runs, for in-process tests and for scripts alike.
HF_SETUP = textwrap.dedent('''
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    def tiny_llama():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return LlamaForCausalLM(config).to(torch.float32)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 16
        def __getitem__(self, i):
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    def hf_trainer(model, out_dir, callbacks, steps=3):
        args = TrainingArguments(output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4,
                                 logging_steps=100, report_to=[], save_strategy="no", use_cpu=True,
                                 disable_tqdm=True, ddp_find_unused_parameters=False, seed=0)
        return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
''')

PL_SETUP = textwrap.dedent('''
    import os, torch
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self, crash_at=None):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
            self.crash_at = crash_at
        def training_step(self, batch, i):
            if i == self.crash_at:  # what a batch left on the host says when the model is on a GPU
                raise RuntimeError("Expected all tensors to be on the same device, but found at least two "
                                   "devices, cuda:0 and cpu! (when checking argument for argument mat1 in "
                                   "method wrapper_CUDA_addmm)")
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def pl_data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def pl_trainer(out_dir, callbacks, world=1):
        return pl.Trainer(max_steps=3, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                          callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=str(out_dir))
''')

# Under torchrun: count the process groups made, see the group at train start and after, compare the
# trained weights of the ranks (equal only if DDP's all-reduces went through the group).
DISTRIBUTED = textwrap.dedent('''
    import json, sys
    import torch.distributed as dist
    made = []
    real_init = dist.init_process_group
    def counting_init(*args, **kwargs):
        made.append(kwargs.get("backend") or (args[0] if args else None))
        return real_init(*args, **kwargs)
    dist.init_process_group = counting_init
    seen = {}
    def at_start():
        seen["initialized"] = dist.is_initialized()
        seen["group"] = id(dist.group.WORLD) if dist.is_initialized() else None
    def report(framework, callback, model, step):
        rank = dist.get_rank()
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        out = {"rank": rank, "made": made, "initialized_at_start": seen["initialized"],
               "same_group_after": seen["group"] == id(dist.group.WORLD), "preflight_done": callback.preflight_done,
               "record": callback.record.to_dict() if callback.record is not None else None,
               "step": step, "checksum": checksum, "hooked": getattr(sys.excepthook, "_mleng_crash_hook", False)}
        with open(f"{framework}-rank{rank}.json", "w") as f:
            json.dump(out, f, default=str)
        # As a training script should: a gloo group left to the interpreter's exit can abort there
        # ("terminate called without an active exception"), once seen under a loaded CI machine.
        dist.barrier()
        dist.destroy_process_group()
''')

HF_DISTRIBUTED = DISTRIBUTED + HF_SETUP + textwrap.dedent('''
    from transformers import TrainerCallback
    from mleng.integrations.hf import MlengCallback

    class AtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            at_start()

    callback = MlengCallback(timeout=10, max_seconds=3, straggler_ratio=0)  # a shared CPU: who is slow is luck
    model = tiny_llama()
    trainer = hf_trainer(model, "out", [AtStart(), callback])
    trainer.train()
    report("hf", callback, model, trainer.state.global_step)
''')

PL_DISTRIBUTED = DISTRIBUTED + PL_SETUP + textwrap.dedent('''
    from mleng.integrations.lightning import MlengCallback

    class AtStart(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            at_start()

    callback = MlengCallback(timeout=10, max_seconds=3, straggler_ratio=0)  # a shared CPU: who is slow is luck
    model = Tiny()
    trainer = pl_trainer("out", [AtStart(), callback], world=2)
    trainer.fit(model, pl_data())
    report("pl", callback, model, trainer.global_step)
''')

# Crashes in training (the preflight is tested above): with the hook (argv[1] == "hook") and without.
HF_CRASH = HF_SETUP + textwrap.dedent('''
    import sys
    from mleng.integrations.hf import MlengCallback

    class Crashing(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 2:  # what a batch left on the host says when the model is on a GPU
                raise RuntimeError("Expected all tensors to be on the same device, but found at least two "
                                   "devices, cuda:0 and cpu! (when checking argument for argument mat1 in "
                                   "method wrapper_CUDA_addmm)")
            return super().forward(input_ids=input_ids, labels=labels, **kwargs)

    tiny = tiny_llama()
    model = Crashing(tiny.config)
    model.load_state_dict(tiny.state_dict())
    callback = MlengCallback(preflight=False, install_crash_hook=sys.argv[1] == "hook")
    print("training", flush=True)
    hf_trainer(model, "out", [callback]).train()
''')

PL_CRASH = PL_SETUP + textwrap.dedent('''
    import sys
    from mleng.integrations.lightning import MlengCallback

    callback = MlengCallback(preflight=False)
    pl_trainer("out", [callback]).fit(Tiny(crash_at=1), pl_data())
''')

NOTE = "mleng: the handbook knows this error: "


def _env(home, **extra):
    """A clean job environment: no launcher or SLURM variables of an outer job, nothing fetched from the Hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    return dict(env, MLENG_HOME=str(home), PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(home / "hf"), **extra)


def _start(argv, cwd, env):
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                        ("HF_HOME", str(tmp_path / "hf"))):
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the hook the callback installs goes afterwards


def _namespace(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "<setup>", "exec"), namespace)  # noqa: S102 - the test's own model code
    return namespace


def _stored() -> list[dict]:
    import mleng

    with mleng.results.Store() as store:  # under MLENG_HOME
        return store.list(kind="preflight")


# ---------------------------------------------------------------------------------------------
# Importing
# ---------------------------------------------------------------------------------------------

def test_import_mleng_imports_no_framework_and_a_missing_one_names_its_extra():
    code = textwrap.dedent('''
        import sys
        import mleng, mleng.integrations
        from mleng.integrations._common import MlengCallbackOptions
        print(sorted(m for m in ("transformers", "lightning", "pytorch_lightning", "accelerate") if m in sys.modules))
        for name in ("transformers", "lightning", "pytorch_lightning"):
            sys.modules[name] = None  # as if not installed
        for module in ("mleng.integrations.hf", "mleng.integrations.lightning"):
            try:
                __import__(module)
            except ImportError as exc:
                print(exc, exc.__cause__, exc.__suppress_context__)
        try:
            MlengCallbackOptions(timout=3)
        except TypeError as exc:
            print(exc)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "[]"
    assert lines[1] == "mleng.integrations.hf needs transformers, which is not installed: pip install 'mleng[hf]' None True"
    assert lines[2] == ("mleng.integrations.lightning needs lightning, which is not installed: "
                        "pip install 'mleng[lightning]' None True")
    assert lines[3].startswith("MlengCallbackOptions: got an unexpected keyword argument 'timout'"), lines[3]


# ---------------------------------------------------------------------------------------------
# A plain single process
# ---------------------------------------------------------------------------------------------

def test_hf_callback_in_a_plain_run_records_its_preflight_and_installs_the_hook(offline, mleng_home, tmp_path, capfd):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from mleng.integrations.hf import MlengCallback

    ns = _namespace(HF_SETUP)
    callback = MlengCallback(max_seconds=3)
    trainer = ns["hf_trainer"](ns["tiny_llama"](), tmp_path / "out", [callback])
    assert getattr(sys.excepthook, "_mleng_crash_hook", False)  # from the trainer's creation on
    result = trainer.train()
    assert trainer.state.global_step == 3 and result.training_loss > 0
    record = callback.record
    assert callback.preflight_done and record.kind == "preflight" and record.status == "complete"
    assert record.summary["verdict"] != "fail" and record.summary["world_size"] == 1
    assert record.summary["group"] == "single process"
    assert record.params["max_seconds"] == 3
    assert [r["id"] for r in _stored()] == [record.id]
    err = capfd.readouterr().err
    assert "mleng preflight: 1 rank on 1 host" in err and f"stored as {record.id}" in err

    # both turned off: no preflight, no hook; a second train() does not repeat a preflight that ran
    sys.excepthook = sys.__excepthook__
    quiet = MlengCallback(preflight=False, install_crash_hook=False)
    ns["hf_trainer"](ns["tiny_llama"](), tmp_path / "out2", [quiet], steps=1).train()
    assert quiet.record is None and not quiet.preflight_done and sys.excepthook is sys.__excepthook__
    trainer.train()
    assert len(_stored()) == 1


def test_lightning_callback_in_a_plain_run_records_its_preflight_and_installs_the_hook(offline, mleng_home,
                                                                                       tmp_path, capfd):
    pytest.importorskip("lightning")
    from mleng.integrations.lightning import MlengCallback

    ns = _namespace(PL_SETUP)
    callback = MlengCallback(max_seconds=3, no_store=True)
    trainer = ns["pl_trainer"](tmp_path / "out", [callback])
    trainer.fit(ns["Tiny"](), ns["pl_data"]())
    assert trainer.global_step == 3
    assert getattr(sys.excepthook, "_mleng_crash_hook", False)
    record = callback.record
    assert callback.preflight_done and record.kind == "preflight" and record.summary["verdict"] != "fail"
    assert record.summary["group"] == "single process" and record.params["max_seconds"] == 3
    assert _stored() == []  # no_store went through
    assert "mleng preflight: 1 rank on 1 host" in capfd.readouterr().err


# ---------------------------------------------------------------------------------------------
# Under torchrun: the trainer's own process group
# ---------------------------------------------------------------------------------------------

def _torchrun(script: str, framework: str, tmp_path) -> tuple[subprocess.CompletedProcess, dict]:
    home = tmp_path / "home"
    (tmp_path / "train.py").write_text(script)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train.py"], cwd=tmp_path, env=_env(home), capture_output=True, text=True, timeout=150)
    ranks = {}
    for rank in (0, 1):
        path = tmp_path / f"{framework}-rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing (exit {proc.returncode})\n{proc.stderr[-6000:]}"
        ranks[rank] = json.loads(path.read_text())
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc, ranks


def _check_distributed(proc, ranks):
    for rank in (0, 1):
        r = ranks[rank]
        assert len(r["made"]) == 1, r["made"]  # the trainer's group, and no other
        assert r["initialized_at_start"] and r["same_group_after"] and r["preflight_done"] and r["hooked"]
        assert r["step"] == 3
    assert ranks[1]["record"] is None
    summary = ranks[0]["record"]["summary"]
    assert summary["group"] == "job's group" and summary["backend"] == "gloo" and summary["world_size"] == 2
    assert summary["verdict"] != "fail"
    checks = {row["check"]: row["severity"] for row in ranks[0]["record"]["rows"]}
    assert checks["join"] == checks["all_reduce"] == "ok", checks
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # DDP kept the ranks' weights equal: training went on
    assert "mleng preflight: 2 ranks on 1 host" in proc.stderr and "job's group, backend gloo" in proc.stderr


def test_hf_callback_under_torchrun_uses_the_trainers_process_group(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _check_distributed(*_torchrun(HF_DISTRIBUTED, "hf", tmp_path))


def test_lightning_callback_under_torchrun_uses_the_strategys_process_group(tmp_path):
    pytest.importorskip("lightning")
    _check_distributed(*_torchrun(PL_DISTRIBUTED, "pl", tmp_path))


# ---------------------------------------------------------------------------------------------
# A crash in training
# ---------------------------------------------------------------------------------------------

def _same(text: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", text)


def _crash(script: str, tmp_path, home, modes):
    (tmp_path / "train.py").write_text(script)
    return [_start([sys.executable, "train.py", mode], tmp_path, _env(home)) for mode in modes]


def _split_note(err: str) -> tuple[str, str]:
    """What the process printed before the hook's note (the traceback ends it), and the note."""
    assert NOTE in err, err[-3000:]
    before, note = err[:err.index(NOTE)], err[err.index(NOTE):]
    assert "Traceback (most recent call last)" in before and NOTE not in note[1:]
    assert before.rstrip().endswith("method wrapper_CUDA_addmm)"), before[-2000:]  # the exception's own line
    assert note.startswith(NOTE) and "tensors-on-different-devices" in note, note
    assert "mleng handbook show " in note and "  fix: - " in note
    return before, note


def test_a_crash_in_training_gets_the_handbook_note_after_the_unchanged_traceback(tmp_path, index_home):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    plain, hooked = _crash(HF_CRASH, tmp_path, index_home, ("plain", "hook"))
    (p_out, p_err), (h_out, h_err) = plain.communicate(timeout=150), hooked.communicate(timeout=150)
    assert plain.returncode == hooked.returncode == 1, h_err[-3000:]
    assert h_out == p_out == "training\n"
    assert NOTE not in p_err and p_err.rstrip().endswith("method wrapper_CUDA_addmm)"), p_err[-3000:]
    before, _ = _split_note(h_err)
    assert _same(before) == _same(p_err), f"plain:\n{p_err[-3000:]}\nhooked:\n{h_err[-3000:]}"


def test_a_crash_in_lightning_training_gets_the_handbook_note(tmp_path, index_home):
    pytest.importorskip("lightning")
    (hooked,) = _crash(PL_CRASH, tmp_path, index_home, ("hook",))
    _, err = hooked.communicate(timeout=150)
    assert hooked.returncode == 1, err[-3000:]
    _split_note(err)
