"""Wire encodings: exact fp32 round trips, low-precision transfer with fp32 masters, top-k."""

from __future__ import annotations

import pytest
import torch

from harness.inprocess import InProcessServer
from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig
from rpcps.errors import PushRejected
from rpcps.signature import FlatLayout, ModelSignature
from rpcps.tasks import teacher_student_model
from rpcps.wire import TopK, to_dense_fp32
from worker.device import GradientStager, ParameterSink, load_parameters

SGD = OptimizerConfig(name="sgd", kwargs={"lr": 1.0})


def test_flat_buffer_round_trip_is_exact_in_fp32() -> None:
    model = teacher_student_model()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    layout = FlatLayout(ModelSignature.of_module(model), chunk_bytes=64 * 1024)
    params = list(model.parameters())
    stager = GradientStager(layout, params, torch.device("cpu"))
    buffers = stager.new_buffers()
    stager.stage(buffers)
    for view, p in zip(layout.views(buffers), params):
        assert torch.equal(view, p.grad)
    fresh = teacher_student_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_parameters(layout, list(fresh.parameters()), buffers)
    for a, b in zip(fresh.parameters(), (p.grad for p in params)):
        assert torch.equal(a, b)


def test_stager_reuses_views_of_its_own_buffers_and_stages_each_set_exactly() -> None:
    model = teacher_student_model()
    layout = FlatLayout(ModelSignature.of_module(model), chunk_bytes=16 * 1024)  # several chunks
    params = list(model.parameters())
    stager = GradientStager(layout, params, torch.device("cpu"))
    sets = [stager.new_buffers() for _ in range(2)]
    foreign = layout.empty_chunks()  # not made by this stager: sliced on the spot
    for seed, buffers in enumerate([*sets, foreign, sets[0]]):
        g = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        stager.stage(buffers)
        for view, p in zip(layout.views(buffers), params):
            assert torch.equal(view, p.grad)


@pytest.mark.parametrize("chunk_bytes", [16 * 1024, 4 << 20])
def test_parameter_sink_loads_into_flat_storage_like_per_parameter_copies(chunk_bytes: int) -> None:
    source = teacher_student_model()
    layout = FlatLayout(ModelSignature.of_module(source), chunk_bytes=chunk_bytes)
    chunks = layout.empty_chunks()
    for view, p in zip(layout.views(chunks), source.parameters()):
        view.copy_(torch.randn_like(p))
    expected, flat = teacher_student_model(), teacher_student_model()
    initial = [p.detach().clone() for p in flat.parameters()]
    load_parameters(layout, list(expected.parameters()), chunks)
    sink = ParameterSink(layout, list(flat.parameters()), torch.float32)
    assert sink.flat is not None  # CPU fp32 parameters: the flat path
    for p, before in zip(flat.parameters(), initial):  # rebinding keeps the values
        assert torch.equal(p, before)
    sink.load(chunks)
    for a, b in zip(flat.parameters(), expected.parameters()):
        assert torch.equal(a, b)
    inputs = torch.randn(4, 32)
    flat(inputs).sum().backward()  # the model still trains on its rebound parameters
    assert all(p.grad is not None and p.grad.shape == p.shape for p in flat.parameters())
    with pytest.raises(ValueError, match="same model and --chunk-mb"):
        sink.load([c[:-1] for c in chunks])


def test_parameter_sink_adopts_large_pulled_chunks_as_the_models_storage_and_copies_what_it_cannot_adopt() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    params = list(model.parameters())
    layout = FlatLayout(ModelSignature.of_module(model), chunk_bytes=4 << 20)
    sink = ParameterSink(layout, params, torch.float32)
    assert sink.adopts  # 260 KiB over 4 parameters: re-pointing them costs less than a copy
    pulled = [torch.randn(n) for n in layout.chunk_numels]
    expected = [v.clone() for v in layout.views(pulled)]
    sink.load(pulled)
    assert all(p.data_ptr() == v.data_ptr() for p, v in zip(params, layout.views(pulled)))  # no copy
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    model(torch.randn(3, 256)).sum().backward()  # gradients still land on the adopted parameters
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)

    # A chunk that is a view into a larger buffer would pin that buffer: copied into the model's own storage.
    backing = torch.randn(layout.chunk_numels[0] + 8)
    sliced = [backing[8:]]
    sink.load(sliced)
    assert params[0].data_ptr() == pulled[0].data_ptr()  # still the storage adopted before, now holding the copy
    assert all(torch.equal(p, v) for p, v in zip(params, layout.views(sliced)))


def test_parameter_sink_copies_chunks_too_small_to_pay_for_re_pointing_every_parameter() -> None:
    model = teacher_student_model()  # 6 parameters in 86 KiB
    params = list(model.parameters())
    layout = FlatLayout(ModelSignature.of_module(model), chunk_bytes=4 << 20)
    sink = ParameterSink(layout, params, torch.float32)
    assert not sink.adopts
    own = [p.data_ptr() for p in params]
    pulled = [torch.randn(n) for n in layout.chunk_numels]
    sink.load(pulled)
    assert [p.data_ptr() for p in params] == own
    assert all(torch.equal(p, v) for p, v in zip(params, layout.views(pulled)))


def test_parameter_sink_loads_parameter_by_parameter_when_the_wire_is_narrower() -> None:
    model = teacher_student_model()
    layout = FlatLayout(ModelSignature.of_module(model), chunk_bytes=64 * 1024)
    sink = ParameterSink(layout, list(model.parameters()), torch.bfloat16)
    assert sink.flat is None
    chunks = [torch.ones(n, dtype=torch.bfloat16) for n in layout.chunk_numels]
    sink.load(chunks)
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_parameter_sink_subtracts_a_pushed_delta_from_what_it_loaded(wire: torch.dtype) -> None:
    """Overlapped local steps: the parameters become the loaded ones minus a round still on the wire,
    on the flat path (after adopting the pulled chunks, which the model then owns) and parameter by parameter."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    params = list(model.parameters())
    layout = FlatLayout(ModelSignature.of_module(model), chunk_bytes=4 << 20)
    sink = ParameterSink(layout, params, wire)
    assert (sink.flat is not None) == (wire == torch.float32)
    pulled = [torch.randn(n).to(wire) for n in layout.chunk_numels]
    delta = [torch.randn(n).to(wire) for n in layout.chunk_numels]
    expected = [(a.float() - d.float()) for a, d in zip(layout.views(pulled), layout.views(delta))]
    sink.load(pulled)
    sink.subtract(delta)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e.view_as(p), rtol=0, atol=0)


def test_bound_buffers_receive_the_same_gradients_backward_would_make() -> None:
    torch.manual_seed(0)
    model = teacher_student_model()
    inputs = torch.randn(8, next(model.parameters()).shape[1])
    layout = FlatLayout(ModelSignature.of_module(model), chunk_bytes=64 * 1024)
    params = list(model.parameters())
    stager = GradientStager(layout, params, torch.device("cpu"))
    assert stager.direct
    model(inputs).square().sum().backward()
    expected = stager.new_buffers()
    stager.stage(expected)
    bound = stager.new_buffers()
    for b in bound:
        b.fill_(7.0)  # whatever a previous step left: bind must start from zero
    for p in params:
        p.grad = None
    stager.bind(bound)
    model(inputs).square().sum().backward()
    for got, want in zip(bound, expected):
        assert torch.equal(got, want)
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(params, layout.views(bound)))  # written in place


def test_a_stager_for_another_dtype_stages_instead_of_binding() -> None:
    model = teacher_student_model()
    layout = FlatLayout(ModelSignature.of_module(model), chunk_bytes=64 * 1024)
    assert not GradientStager(layout, list(model.parameters()), torch.device("cpu"), torch.bfloat16).direct


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_low_precision_wire_keeps_fp32_masters(wire: str) -> None:
    server = InProcessServer(teacher_student_model(), ServerCoreConfig(optimizer=SGD, wire_dtype=wire))
    inc = server.register(0, "w0", server.model_signature.to_wire()).incarnation
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[wire]
    before = server.master_tensors()
    grads = [torch.full((n,), 0.5, dtype=dtype) for n in server.layout.chunk_numels]
    assert server.push(0, inc, 0, 0, grads).status == "applied"
    after = server.master_tensors()
    assert all(t.dtype == torch.float32 for t in after.values())
    for name in before:
        torch.testing.assert_close(after[name], before[name] - 0.5)
    pulled = server.pull(0, inc, -1)
    assert pulled.chunks is not None and pulled.chunks[0].dtype == dtype
    with pytest.raises(PushRejected, match=f"has dtype torch.float32, expected {dtype}"):
        server.push(0, inc, 1, 1, [torch.zeros(n) for n in server.layout.chunk_numels])


def test_sparse_chunks_are_densified_and_checked() -> None:
    server = InProcessServer(teacher_student_model(), ServerCoreConfig(optimizer=SGD))
    inc = server.register(0, "w0", server.model_signature.to_wire()).incarnation
    (numel,) = server.layout.chunk_numels
    before = server.master_tensors()
    sparse = [(torch.tensor([0, 5]), torch.tensor([1.0, 2.0]))]
    assert server.push(0, inc, 0, 0, sparse).status == "applied"
    flat_before = torch.cat([t.flatten() for t in before.values()])
    flat_after = torch.cat([t.flatten() for t in server.master_tensors().values()])
    changed = (flat_before != flat_after).nonzero().flatten().tolist()
    assert changed == [0, 5]
    with pytest.raises(PushRejected, match="sparse indices outside"):
        server.push(0, inc, 1, 1, [(torch.tensor([numel]), torch.tensor([1.0]))])
    with pytest.raises(PushRejected, match="NaN/Inf in parameter '0.weight'"):
        server.push(0, inc, 2, 1, [(torch.tensor([3]), torch.tensor([float("nan")]))])


def test_sparse_chunks_cannot_hold_more_entries_than_the_chunk() -> None:
    """A member cannot make the server index more than a dense chunk's worth (docs/SECURITY.md)."""
    server = InProcessServer(teacher_student_model(), ServerCoreConfig(optimizer=SGD))
    inc = server.register(0, "w0", server.model_signature.to_wire()).incarnation
    (numel,) = server.layout.chunk_numels
    every = torch.arange(numel)
    assert server.push(0, inc, 0, 0, [(every, torch.zeros(numel))]).status == "applied"  # ratio 1 is fine
    repeated = torch.zeros(numel + 1, dtype=torch.int64)
    with pytest.raises(PushRejected, match=f"has {numel + 1} sparse entries, more than the chunk's {numel} elements"):
        server.push(0, inc, 1, 1, [(repeated, torch.zeros(numel + 1))])


def test_topk_error_feedback_sends_everything_eventually() -> None:
    topk = TopK((100,), ratio=0.1, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    total_in = torch.zeros(100)
    total_sent = torch.zeros(100)
    for _ in range(30):
        grad = torch.randn(100, generator=g)
        total_in += grad
        (chunk,) = topk.compress([grad])
        assert chunk[0].numel() == 10
        total_sent += to_dense_fp32(chunk, 100)
    torch.testing.assert_close(total_sent + topk.residual[0], total_in)
