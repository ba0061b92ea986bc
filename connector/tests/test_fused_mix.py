"""mix128's fused kernel (fusedmix.py): the torch ops' digests, checked on the CPU in Triton's interpreter
(test_gpu.py checks it compiled on a GPU), and the torch ops kept wherever it does not give them."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvscope_connector import blocks, fusedmix
from kvscope_connector.blocks import mix_digests

pytest.importorskip("triton")


def test_the_kernel_gives_the_torch_ops_digests_in_tritons_interpreter():
    script = textwrap.dedent("""
        import torch
        from kvscope_connector import blocks, fusedmix
        gen = torch.Generator().manual_seed(5)
        B = fusedmix.BLOCK
        for n, words in [(0, 8), (1, 1), (3, 1000), (2, B), (4, 2 * B + 3), (2, 3 * B - 1)]:
            rows = torch.randint(0, 256, (n, 8 * words), dtype=torch.uint8, generator=gen)
            rows[:, 7::8] |= 0x80  # every word negative as int64: the shifts must be logical
            got = fusedmix.digests(rows.view(torch.int64), blocks._device_keys(words, rows.device))
            assert torch.equal(got, blocks.mix_digests(rows, fused=False)), (n, words)
        assert blocks.agrees(torch.device("cpu"), 8 * (2 * B + 5)) and blocks.agrees(torch.device("cpu"), 8 * 3 * B)
        print("same digests")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "same digests" in out.stdout, out.stderr[-2000:]


def test_a_kernel_that_fails_or_gives_other_digests_leaves_the_torch_ops_logged(monkeypatch, caplog):
    cpu = torch.device("cpu")
    monkeypatch.setattr(fusedmix, "digests", lambda words, keys: torch.zeros((len(words), 2), dtype=torch.int64))
    with caplog.at_level(logging.WARNING, logger="kvscope_connector"):
        assert not blocks.agrees(cpu, 64)

    def fails(words, keys):
        raise RuntimeError("no kernel image for this device")
    monkeypatch.setattr(fusedmix, "digests", fails)
    with caplog.at_level(logging.WARNING, logger="kvscope_connector"):
        assert not blocks.agrees(cpu, 64)
    assert "other digests" in caplog.text and "no kernel image" in caplog.text


def test_the_kernel_is_checked_at_each_size_it_runs_at_as_triton_compiles_one_per_kind_of_size(monkeypatch):
    # Triton compiles the kernel again for a width divisible by 16: one right at the sample's size may be wrong
    # at the blocks' own
    def wrong_when_divisible(words, keys):
        w = words.clone()
        if w.shape[1] % 16 == 0:
            w[:, -1] = 0  # drops the last word
        return mix_digests(w.view(torch.uint8), fused=False)
    monkeypatch.setattr(fusedmix, "digests", wrong_when_divisible)
    cpu = torch.device("cpu")
    assert blocks.agrees(cpu, 8 * 8197) and not blocks.agrees(cpu, 8 * 4096)
    tried = []
    monkeypatch.setattr(blocks, "_fused", {})
    monkeypatch.setattr(blocks, "agrees", lambda device, nbytes: tried.append(nbytes) or nbytes == 64)
    gpu = torch.device("cuda")
    assert [blocks.fused_on(gpu, n) for n in (64, 128, 64, 128)] == [True, False, True, False] and tried == [64, 128]
    assert not blocks.fused_on(cpu, 64) and tried == [64, 128]  # only a CUDA GPU runs the kernel


def test_mix_digests_runs_the_kernel_only_where_chosen_on_contiguous_aligned_rows(monkeypatch):
    marker = torch.full((2, 2), 7, dtype=torch.int64)
    monkeypatch.setattr(fusedmix, "digests", lambda words, keys: marker)
    monkeypatch.setattr(blocks, "fused_on", lambda device, nbytes: nbytes == 64)
    wide = torch.randint(0, 256, (2, 64), dtype=torch.uint8)
    rows = wide[:, :32]  # rows of a wider buffer: the kernel reads rows that lie end to end
    shifted = torch.empty(2 * 64 + 8, dtype=torch.uint8)[8:].view(2, 64)  # aligned unlike any it was checked on
    assert mix_digests(wide) is marker
    assert not torch.equal(mix_digests(rows), marker) and not torch.equal(mix_digests(shifted), marker)
    assert not torch.equal(mix_digests(wide, fused=False), marker)
