"""hlo_census: launch counting on a hand-written HLO module whose counts are known, and on compiled programs."""

import jax
import jax.numpy as jnp
import pytest

from dsv4_jax import hlo_census

# Entry: 2 fusions, a custom call, an all-reduce start/done pair, a call into a computation with one copy, and a
# while loop (trip count 7) whose body has 2 fusions and whose condition has 1.
HLO = """HloModule jit_step, is_scheduled=true

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %t = f32[4]{0} tanh(%p)
}

%body (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4]{0} get-tuple-element(%arg), index=1
  %f1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/csa_layer/mhc/while/body/mul"}
  %f2 = s32[] fusion(%i), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/csa_layer/mhc/while/body/add"}
  ROOT %out = (s32[], f32[4]{0}) tuple(%f2, %f1)
}

%cond (arg.1: (s32[], f32[4])) -> pred[] {
  %arg.1 = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] fusion(%arg.1), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/csa_layer/mhc/while/cond/lt"}
}

%outlined (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} copy(%q), metadata={op_name="jit(step)/attention/copy"}
}

ENTRY %main (x.1: f32[4]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0), metadata={op_name="x"}
  %a = f32[4]{0} fusion(%x.1), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/csa_layer/attention/fp8_matmul/dot_general"}
  %b = f32[4]{0} custom-call(%a), custom_call_target="dsv4_fp8_gemv", metadata={op_name="jit(step)/csa_layer/attention/fp8_matmul/ffi_call"}
  %ar = f32[4]{0} all-reduce-start(%b), replica_groups={}, to_apply=%fused_a, metadata={op_name="jit(step)/routed_experts/psum"}
  %ard = f32[4]{0} all-reduce-done(%ar)
  %cl = f32[4]{0} call(%ard), to_apply=%outlined
  %tup = (s32[], f32[4]{0}) tuple(%cl, %cl)
  %w = (s32[], f32[4]{0}) while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %g = f32[4]{0} get-tuple-element(%w), index=1
  ROOT %r = f32[4]{0} fusion(%g), kind=kLoop, calls=%fused_a, metadata={op_name="jit(step)/norm/mul"}
}
"""


def test_counts_of_a_known_module():
    c = hlo_census.census(HLO)
    # entry kernels: a, b, ar (done is not a launch), copy in the call, r = 5; loop: 7 x 2 + 8 x 1 = 22
    assert c.top_level_kernels == 5
    assert c.launches_per_call == 5 + 22
    assert (c.custom_calls, c.while_loops, c.collectives, c.unknown_trip_counts) == (1, 1, 1, 0)
    assert c.by_family == {"fp8 matmul": 2, "attention": 1, "mhc": 22, "norm/rope": 1, "collectives": 1}
    assert c.by_layer_kind == {"csa": 2 + 22, "outside layers": 3}


def test_a_loop_without_a_known_trip_count_is_counted_once_and_flagged():
    c = hlo_census.census(HLO.replace(', backend_config={"known_trip_count":{"n":"7"}}', ""))
    assert c.launches_per_call == 5 + 2 + 2 and c.unknown_trip_counts == 1


def test_op_families_name_every_instruction():
    families = hlo_census.op_families(HLO)
    assert families["b"] == "fp8 matmul" and families["f1"] == "mhc" and families["ar"] == "collectives"
    assert families["x.1"] == "other"


def test_op_sites_name_an_op_without_its_program_or_instance():
    sites = hlo_census.op_sites(HLO.replace("%a = f32[4]{0} fusion(", "%input_reduce_fusion.8.1 = f32[4]{0} fusion(")
                                .replace("fusion(%a)", "fusion(%input_reduce_fusion.8.1)"))
    assert sites["input_reduce_fusion.8.1"] == ("fp8 matmul", "csa_layer/attention/fp8_matmul/dot_general input_reduce")
    assert sites["b"] == ("fp8 matmul", "csa_layer/attention/fp8_matmul/ffi_call b")
    assert sites["f1"] == ("mhc", "csa_layer/mhc/while/body/mul f1")
    assert sites["x.1"] == ("other", "x x")                          # no program scope: the op_name as it is


def test_an_hlo_text_without_entry_is_refused():
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo_census.census("HloModule empty\n")


@pytest.mark.parametrize("unroll", [False, True])
def test_compiled_loops_and_scopes(unroll):
    """A real compile: the fori_loop is a while loop with its trip count unless unrolled, and a matmul under a
    named scope is attributed to that scope."""
    def f(x, w):
        with jax.named_scope("attention"):
            y = jnp.tanh(x @ w)
        return jax.lax.fori_loop(0, 5, lambda i, c: jnp.sin(c) * 2 + 1, y, unroll=unroll).sum()
    text = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8))).compile().as_text()
    c = hlo_census.census(text)
    assert c.while_loops == (0 if unroll else 1) and c.unknown_trip_counts == 0
    assert c.by_family.get("attention", 0) >= 1
    if not unroll:
        assert c.launches_per_call > c.top_level_kernels


def _compiled_text(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_strided_gathers_found_and_sized():
    """A gather of x[slot, :, column] from [slots, N, columns] reads one element per memory sector; x[slot, column]
    from [slots, columns, N] reads whole rows and is not listed."""
    idx = jnp.asarray([3, 0, 2, 1, 3], jnp.int32)
    pos = jnp.asarray([1, 4, 0, 7, 2], jnp.int32)
    strided = hlo_census.strided_gathers(_compiled_text(lambda x, i, p: x[i, :, p] * 2, jnp.ones((4, 64, 8)), idx,
                                                        pos))
    assert len(strided) == 1
    assert strided[0]["slice_sizes"] == [1, 64, 1] and strided[0]["operand"] == "f32[4, 64, 8]"
    assert strided[0]["bytes_used"] == 5 * 64 * 4 and strided[0]["bytes_read"] == 5 * 64 * hlo_census.SECTOR_BYTES
    assert hlo_census.strided_gathers(_compiled_text(lambda x, i, p: x[i, p] * 2, jnp.ones((4, 8, 64)), idx, pos)) == []


def test_moe_kernel_output_gather():
    """The MoE kernel's output read back to row order reads whole rows: its tiles are stored row-major (the
    layout it stored them in before, [slot, N, slot column], is the strided case of the test above)."""
    import numpy as np

    from dsv4_jax.numerics.formats import Mxfp4Weight
    from dsv4_jax.pallas_kernels import moe
    rng = np.random.default_rng(0)
    w = Mxfp4Weight(jnp.asarray(rng.integers(0, 256, (4, 64, 128)), jnp.uint8),
                    jnp.asarray(rng.integers(120, 130, (4, 64, 8)), jnp.uint8))
    x, ids = jnp.ones((40, 256), jnp.bfloat16), jnp.asarray(rng.integers(0, 4, 40), jnp.int32)
    text = _compiled_text(lambda x, w, i: moe.moe_matmul(x, w, i, jnp.float32, interpret=True, slot_cols=32,
                                                          split_k=1), x, w, ids)
    assert [g for g in hlo_census.strided_gathers(text) if 64 in g["slice_sizes"]] == []


def test_slice_copies():
    """A dynamic slice that is a computation's result is a copy (listed, with its bytes); one fused into arithmetic
    is not; slices under the size floor are not; the GPU form (a loop fusion whose root is the slice, beside a
    dynamic-slice-fusion that hands its slice to a custom call in place) is told apart."""
    w, i = jnp.ones((4, 512, 1024), jnp.uint8), jnp.int32(1)
    copied = hlo_census.slice_copies(_compiled_text(lambda w, i: jax.lax.dynamic_index_in_dim(w, i, False), w, i),
                                     2 ** 19)
    assert [(c["operand"], c["slice"], c["bytes"]) for c in copied] == [("u8[4,512,1024]", "u8[1, 512, 1024]", 2 ** 19)]
    fused = _compiled_text(lambda w, i: jax.lax.dynamic_index_in_dim(w, i, False) + 1, w, i)
    assert hlo_census.slice_copies(fused, 2 ** 19) == []
    assert hlo_census.slice_copies(_compiled_text(lambda w, i: jax.lax.dynamic_index_in_dim(w, i, False), w, i),
                                   2 ** 19 + 1) == []
    gpu_text = """
%fused_dynamic_slice.26.clone (param_0.1: u8[2,256,2048,2048], param_1.1: s32[]) -> u8[1,256,2048,2048] {
  %param_0.1 = u8[2,256,2048,2048]{3,2,1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %constant_1 = s32[] constant(0)
  ROOT %dynamic_slice.131 = u8[1,256,2048,2048]{3,2,1,0} dynamic-slice(%param_0.1, %param_1.1, %constant_1, %constant_1, %constant_1), dynamic_slice_sizes={1,256,2048,2048}, metadata={op_name="jit(prefill_chunk)/while/body/dynamic_slice"}
}

%dynamic-slice-fusion (p0: u8[2,256,4096,1024], p1: s32[], p3: bf16[305,8,2048]) -> f32[305,8,4096] {
  %p3 = bf16[305,8,2048]{2,1,0} parameter(2)
  %p0 = u8[2,256,4096,1024]{3,2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %constant_2 = s32[] constant(0)
  %dynamic_slice.198 = u8[1,256,4096,1024]{3,2,1,0} dynamic-slice(%p0, %p1, %constant_2, %constant_2, %constant_2), dynamic_slice_sizes={1,256,4096,1024}
  %bitcast.1248 = u8[256,4096,1024]{2,1,0} bitcast(%dynamic_slice.198)
  ROOT %ffi_call.1 = f32[305,8,4096]{2,1,0} custom-call(%p3, %bitcast.1248), custom_call_target="dsv4_mxfp4_gemv"
}
"""
    copies = hlo_census.slice_copies(gpu_text)
    assert [(c["computation"], c["operand"], c["bytes"]) for c in copies] == [
        ("fused_dynamic_slice.26.clone", "u8[2,256,2048,2048]", 2 ** 30)]
    assert copies[0]["op_name"] == "jit(prefill_chunk)/while/body/dynamic_slice"


def test_kernel_bytes_of_a_known_module():
    """Operands and results of every launch, loop bodies once per iteration (all arrays f32[4], 16 bytes; the
    loop's counter s32[], 4; its condition reads the (s32[], f32[4]) tuple, 20, and writes a pred, 1)."""
    b = hlo_census.kernel_bytes(HLO)
    # a, b: 2 x (16 + 16); the all-reduce 32; the copy 32; r 32; body 7 x (32 + 8); condition 8 x 21
    assert b["by_family"] == {"fp8 matmul": 64, "attention": 32, "mhc": 7 * 40 + 8 * 21, "norm/rope": 32,
                              "collectives": 32}
    assert b["total"] == sum(b["by_family"].values())
    assert b["top_sites"][0] == {"site": "<layer>/mhc/while/body/mul f1", "family": "mhc", "kernels": 7,
                                 "bytes": 7 * 32}


def test_kernel_bytes_count_an_operand_passed_twice_once():
    """A custom call given one array as two operands (the MoE kernels read its two halves) reads it once: 64 + 8
    bytes in, 16 out, not 64 + 64 + 8 + 16."""
    text = """HloModule m, is_scheduled=true

ENTRY %main (x: f32[16], s: s32[2]) -> f32[4] {
  %x = f32[16]{0} parameter(0)
  %s = s32[2]{0} parameter(1)
  ROOT %k = f32[4]{0} custom-call(%s, %x, %x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/routed_experts/fp4_matmul/pallas_call"}
}
"""
    assert hlo_census.kernel_bytes(text)["total"] == 64 + 8 + 16


def test_kernel_bytes_of_an_in_place_update_count_the_update():
    """A compiled in-place dynamic_update_slice of 4 floats into 1,024 counts the update and its index, not the
    buffer; the same update out of place (the buffer is not donated, so XLA copies it) counts the copy."""
    def update(buf, x, i):
        return jax.lax.dynamic_update_slice(buf, x, (i,))
    args = (jnp.ones((1024,)), jnp.ones((4,)), jnp.int32(3))
    text = jax.jit(update, donate_argnums=0).lower(*args).compile().as_text()
    assert hlo_census.kernel_bytes(text)["total"] <= 16 + 4 + 8
    copied = _compiled_text(update, *args)
    assert hlo_census.kernel_bytes(copied)["total"] >= 2 * 4096
