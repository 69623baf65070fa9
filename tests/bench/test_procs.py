import os

from epd_proxy.bench.procs import (
    CLK_TCK,
    all_stats,
    cross_core_rtt,
    machine_busy_seconds,
    parse_proc_stat,
    read_stat,
    rss_bytes,
    tree_cpu_seconds,
    tree_pids,
    wake_write_cost,
)

# A real line, with a command name that contains a space and a parenthesis.
LINE = ("4242 (my (odd) name) S 1 4242 4242 0 -1 4194560 2156 0 0 0 1234 567 8 9 20 0 3 0 11770 "
        "116842496 3791 18446744073709551615 1 1 0 0 0 0 0 16781312 16386 0 0 0 17 1 0 0 0 0 0")


def test_parse_proc_stat_fields():
    st = parse_proc_stat(LINE)
    assert st.pid == 4242
    assert st.comm == "my (odd) name"
    assert st.state == "S"
    assert st.ppid == 1
    assert st.utime == 1234 and st.stime == 567
    assert st.cpu_ticks == 1801
    assert st.num_threads == 3
    assert st.rss_pages == 3791


def test_read_own_stat():
    st = read_stat(os.getpid())
    assert st is not None and st.pid == os.getpid()
    assert st.ppid == os.getppid()
    assert read_stat(2**31 - 1) is None


def test_tree_includes_children():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        pids = tree_pids(os.getpid())
        assert os.getpid() in pids and child.pid in pids
        stats = all_stats()
        assert tree_pids(child.pid, stats) == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_cpu_and_memory_readings():
    t0 = tree_cpu_seconds(os.getpid())
    x = 0
    for i in range(2_000_000):
        x += i
    t1 = tree_cpu_seconds(os.getpid())
    assert t1 >= t0 >= 0
    assert t1 - t0 >= 1.0 / CLK_TCK or t1 > 0
    assert rss_bytes(os.getpid()) > 1 << 20
    assert machine_busy_seconds() > 0


def test_wake_write_cost_measures_both_cases_and_restores_affinity():
    cpus = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    if len(cpus) < 2:
        assert wake_write_cost(cpus[0], cpus[0]) == {}
        return
    got = wake_write_cost(cpus[0], cpus[1], n=40)
    assert set(got) == {"asleep_us", "awake_us"}
    assert got["asleep_us"] > 0 and got["awake_us"] > 0
    assert os.sched_getaffinity(0) == before
    assert wake_write_cost(cpus[0], cpus[0]) == {}  # one core: nothing to compare
    rtt = cross_core_rtt(cpus[0], cpus[1], n=40)
    assert set(rtt) == {"same_core_us", "cross_core_us"} and min(rtt.values()) > 0
    assert os.sched_getaffinity(0) == before


def test_voluntary_switches_count_blocking():
    import time

    from epd_proxy.bench.procs import voluntary_switches

    before = voluntary_switches(os.getpid())
    for _ in range(5):
        time.sleep(0.002)  # each sleep blocks once
    assert voluntary_switches(os.getpid()) >= before + 5
    assert voluntary_switches(2 ** 22 + 12345) != voluntary_switches(2 ** 22 + 12345)  # no such process: NaN
