"""Launch detection, SLURM node lists and the small helpers of mleng.distributed (no processes needed)."""

import pytest

from mleng.distributed.group import first_line
from mleng.distributed.launch import SLURM_PORT_BASE, detect, expand_nodelist
from mleng.machine.system import format_cpulist, parse_cpulist
from mleng.distributed.launch import strip_nproc
from mleng.errors import UsageError


@pytest.mark.parametrize("compact, hosts", [
    ("vm", ["vm"]),
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("a[1-2],b7,c[01,03]", ["a1", "a2", "b7", "c01", "c03"]),
    ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
    ("127.0.0.[1]", ["127.0.0.1"]),
])
def test_expand_nodelist(compact, hosts):
    assert expand_nodelist(compact) == hosts


@pytest.mark.parametrize("bad", ["n[1-3", "n[a-b]", ""])
def test_expand_nodelist_refuses_garbage(bad):
    with pytest.raises(UsageError):
        expand_nodelist(bad)


def test_nobody_launched_us_means_plain():
    assert detect({"PATH": "/bin"}) is None


def test_torchrun_environment():
    launch = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                     "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7",
                     "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (launch.mode, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == \
        ("torchrun", 3, 8, 1, 4)
    assert launch.agent_store and launch.run_id == "job7.2"


def test_hand_set_environment_and_its_mistakes():
    base = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    launch = detect(base)
    assert launch.mode == "env" and not launch.agent_store
    with pytest.raises(UsageError, match="outside WORLD_SIZE"):
        detect({**base, "RANK": "2"})
    with pytest.raises(UsageError, match="MASTER_ADDR or MASTER_PORT"):
        detect({k: v for k, v in base.items() if k != "MASTER_PORT"})
    with pytest.raises(UsageError, match="not an integer"):
        detect({**base, "WORLD_SIZE": "two"})


def test_srun_step_environment():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[03-04]",
           "SLURM_NTASKS_PER_NODE": "4"}
    launch = detect(env)
    assert (launch.mode, launch.rank, launch.world_size, launch.local_rank) == ("srun", 5, 8, 1)
    assert launch.master_addr == "gpu03"
    assert launch.master_port == SLURM_PORT_BASE + 4242 % 10000
    assert detect({**env, "MASTER_ADDR": "head", "MASTER_PORT": "777"}).master_addr == "head"


def test_batch_script_and_single_task_steps_are_plain():
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert detect(batch) is None  # no step id: the batch script itself, not a task of srun
    assert detect({**batch, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is None


def test_torch_variables_win_over_slurm_ones():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_NODELIST": "n1",
           "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "5000",
           "TORCHELASTIC_RUN_ID": "x"}
    assert detect(env).mode == "torchrun" and detect(env).world_size == 4


def test_strip_nproc():
    assert strip_nproc(["comm", "--nproc", "4", "--check"]) == ["comm", "--check"]
    assert strip_nproc(["check", "--nproc=2", "--timeout", "5"]) == ["check", "--timeout", "5"]


def test_cpu_lists_round_trip():
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]


def test_first_line_drops_source_location_and_stack():
    exc = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                       "[127.0.0.1]:32900. This is typically caused by a remote worker crashing. Check the logs of "
                       "the remote worker before reporting an error. GLHF!\nframe #0: ...")
    assert first_line(exc).startswith("Connection closed by peer [127.0.0.1]:32900")
    assert "frame" not in first_line(exc) and "GLHF" not in first_line(exc)


def test_srun_block_layout_says_where_each_rank_should_be():
    from mleng.distributed.launch import block_layout

    assert block_layout(["a", "b", "c"], "2(x2),1") == ["a", "a", "b", "b", "c"]
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "9",
           "SLURM_STEP_NODELIST": "gpu[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    assert detect(env).expected_hosts == ("gpu1", "gpu1", "gpu2", "gpu2")
    assert detect({**env, "SLURM_DISTRIBUTION": "cyclic"}).expected_hosts is None
    with pytest.raises(UsageError):
        block_layout(["a"], "2(x2)")
