"""CPU thread defaults for vLLM engines on small hosts (serve_app/engine/vllm_engine.py)."""

from serve_app.engine.vllm_engine import SMALL_HOST_CPUS, cpu_thread_env


def test_two_core_host_binds_every_core_and_waits_passively():
    assert cpu_thread_env({1, 0}, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "OMP_WAIT_POLICY": "PASSIVE"}


def test_affinity_subset_is_respected():
    # A container pinned to cores 2 and 5 must bind there, not to 0 and 1.
    assert cpu_thread_env({5, 2}, {})["VLLM_CPU_OMP_THREADS_BIND"] == "2,5"


def test_operator_settings_win_key_by_key():
    assert cpu_thread_env({0, 1}, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_thread_env({0, 1}, {"OMP_WAIT_POLICY": "ACTIVE"}) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert cpu_thread_env({0, 1}, {"VLLM_CPU_OMP_THREADS_BIND": "auto", "OMP_WAIT_POLICY": "ACTIVE"}) == {}


def test_big_host_keeps_vllms_own_choices():
    assert cpu_thread_env(set(range(SMALL_HOST_CPUS + 1)), {}) == {}
    assert cpu_thread_env(set(range(SMALL_HOST_CPUS)), {}) != {}


def test_no_affinity_information_changes_nothing():
    assert cpu_thread_env(set(), {}) == {}
