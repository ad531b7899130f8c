"""bench/measure.py counts each address space of a process tree once (a vfork child before exec shares its
parent's, and /proc reports the parent's whole RSS for it)."""
import os
import subprocess
import sys

import psutil

from bench.measure import same_address_space, tree_rss


def test_a_process_shares_its_own_address_space_and_not_a_forked_childs():
    assert same_address_space(os.getpid(), os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not same_address_space(os.getpid(), child.pid)
    finally:
        child.kill()
        child.wait()


def test_tree_rss_adds_a_separate_child_once():
    me = psutil.Process()
    alone = tree_rss(me)
    # the child holds 200 MB of its own, written so that it is resident
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
                              "print('ready', flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with_child = tree_rss(me)
        assert with_child - alone >= 200 << 20
        assert with_child - alone <= psutil.Process(child.pid).memory_info().rss + (64 << 20)
    finally:
        child.kill()
        child.wait()
