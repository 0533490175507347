# SPDX-License-Identifier: Apache-2.0
"""The build compiles every program and the kernel verifier accepts every one of them."""
import glob
import os

import pytest

from conftest import BPF_DIR

from agent.libbpf import BpfError, Object
from agent.programs import TcpBackpressure


def test_build_produces_every_object(bpf_build):
    sources = sorted(os.path.basename(p)[: -len(".bpf.c")] for p in glob.glob(f"{BPF_DIR}/*.bpf.c"))
    built = sorted(os.path.basename(p)[: -len(".bpf.o")] for p in glob.glob(f"{bpf_build}/*.bpf.o"))
    assert sources == built == ["cudalat", "sockredir", "tcpbp"]


@pytest.mark.parametrize("obj", ["sockredir", "cudalat"])
def test_verifier_accepts(bpf_build, obj):
    with Object(os.path.join(bpf_build, f"{obj}.bpf.o")) as o:
        o.load()


@pytest.mark.parametrize("mode", ["tracepoint", "fentry"])
def test_verifier_accepts_tcpbp(bpf_build, mode):
    with Object(os.path.join(bpf_build, "tcpbp.bpf.o")) as o:
        use = TcpBackpressure.FENTRY if mode == "fentry" else TcpBackpressure.TRACEPOINT
        for prog in TcpBackpressure.FENTRY + TcpBackpressure.TRACEPOINT:
            o.program(prog).set_autoload(prog in use)
        try:
            o.load()
        except BpfError as e:
            if mode == "fentry":
                pytest.skip(f"this kernel refuses fentry ({e}); the agent falls back to the tracepoint")
            raise
