"""benchmarks/command_buffers.py reads XLA's CommandBufferConversionPass log: lines as XLA 0.11.2 writes them (taken from
a compile of the 4-layer Flash step, shortened), with a helper program, a while loop and every reason a kernel stays
outside a command buffer."""

from benchmarks.command_buffers import main, parse, summary

_P = "I1204 20:25:16.225599   13034 command_buffer_conversion_pass.cc"
LOG = f"""\
{_P}:652] Module Anonymous CommandBufferConfig: enabled_commands: [], enabled_collectives: [ALLCOLLECTIVES]
{_P}:392] Thunk kind kCustomKernel lowering is not enabled by the user for type FUSION
an unrelated line in between
{_P}:652] Module jit_decode_step CommandBufferConfig: enabled_commands: [DYNAMIC_SLICE_FUSION, FUSION], \
enabled_collectives: [ALLCOLLECTIVES]
{_P}:392] Thunk kind kCustomCall lowering is not enabled by the user for type CUSTOM_CALL
{_P}:564] Creating command buffer thunk with the following thunks: copy.41, loop_add_fusion.1, pallas_call.119
{_P}:588] Thunk kind kCustomKernel is not lowered to command buffer because command size is less than the min graph \
size
{_P}:564] Creating command buffer thunk command_buffer_7 with the following thunks: gemm_fusion_dot.24, \
input_concatenate_fusion.6
{_P}:120] Unsupported thunk kind: kHostSend
{_P}:652] Module jit_generate_chunk CommandBufferConfig: enabled_commands: [FUSION, CUSTOM_CALL], \
enabled_collectives: [ALLCOLLECTIVES]
{_P}:392] Thunk kind kWhile lowering is not enabled by the user for type WHILE
"""


def test_parse_counts_segments_and_the_kernels_left_outside():
    programs = parse(LOG.splitlines())
    assert [p["module"] for p in programs] == ["Anonymous", "jit_decode_step", "jit_generate_chunk"]
    step = summary(programs[1])
    assert step["enabled_commands"] == ["DYNAMIC_SLICE_FUSION", "FUSION"]
    assert step["command_buffers"] == 2 and step["thunks_in_command_buffers"] == 5
    assert programs[1]["command_buffers"][1] == ["gemm_fusion_dot.24", "input_concatenate_fusion.6"]
    assert step["thunks_outside"] == 3
    assert step["outside_by_reason"] == {
        "kCustomCall: lowering is not enabled by the user for type CUSTOM_CALL": 1,
        "kCustomKernel: shorter than the min graph size": 1, "kHostSend: kind not supported": 1}
    loop = summary(programs[2])
    assert (loop["command_buffers"], loop["thunks_outside"]) == (0, 1)


def test_main_prints_the_named_programs_and_refuses_a_log_without_the_pass(tmp_path, capsys):
    log = tmp_path / "compile.log"
    log.write_text(LOG)
    assert main([str(log), "--json", str(tmp_path / "cb.json")]) == 0
    out = capsys.readouterr().out
    assert "jit_decode_step" in out and "Anonymous" not in out
    assert (tmp_path / "cb.json").read_text().count('"module"') == 2
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    assert main([str(empty)]) == 1
    assert "TF_CPP_VMODULE" in capsys.readouterr().err
