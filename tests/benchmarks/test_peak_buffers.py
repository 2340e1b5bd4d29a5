"""benchmarks/peak_buffers.py replays the TPU compiler's buffer table: the peak, what is alive there, and the
JAX operation of each buffer with layer indices folded."""
from __future__ import annotations

import chex

from benchmark_scripts import load as load_script

TABLE = """buffer_id,buffer_name,alt_mem_benefit,size,definition_time,use_times,use_names,is_scoped
1,"<11 param.1>",0,100,0,"9","x, operand 0",0
2,"<12 fusion.1{0}>",0,40,2,"8","y, operand 0",0
3,"<13 fusion.2{1}>",0,40,3,"7","y, operand 1",0
4,"<14 fusion.3>",0,500,10,"11","z, operand 0",0
5,"<15 fusion.4>",0,70,4,"5","w, operand 0",0
6,"<16 scratch.1>",0,9999,4,"5","w, operand 1",1
"""
HLO = """HloModule jit_step, is_scheduled=true
  %param.1 = bf16[8]{0} parameter(0), metadata={op_name="state.params['layers_0']['w']"}
  %fusion.1 = (bf16[4]{0}, bf16[4]{0}) fusion(%param.1), kind=kLoop, metadata={op_name="jit(step)/layers_3/mlp/mul" stack_frame_id=1}
  %fusion.2 = (bf16[4]{0}, bf16[4]{0}) fusion(%param.1), kind=kLoop, metadata={op_name="jit(step)/layers_12/mlp/mul"}
  ROOT %fusion.4 = bf16[4]{0} fusion(%param.1), kind=kLoop, metadata={op_name="jit(step)/blocks_1/attn/neg"}
"""


def test_the_peak_and_what_is_alive_there(tmp_path, capsys):
    mod = load_script("peak_buffers")
    (tmp_path / "1-TLP-00-memory-space-assignment-bufferinfo.txt").write_text(TABLE)
    (tmp_path / "2-TLP-hlo.txt").write_text(HLO)
    result = mod.main([str(tmp_path), "--json", str(tmp_path / "out.json")])
    # the 500-byte buffer lives alone (steps 10-11); steps 4-5 hold 100 + 40 + 40 + 70; scoped scratch is not HBM
    chex.assert_equal(result["peak_bytes"], 500)
    assert result["alive"] == 1 and result["groups"][0]["operation"] == "fusion.3"  # no metadata: its name
    assert "warning: only 0 of those buffers are named in 2-TLP-hlo.txt" in capsys.readouterr().out
    buffers = mod.read_buffers(tmp_path / "1-TLP-00-memory-space-assignment-bufferinfo.txt")
    top, at, alive = mod.peak([b for b in buffers if b.size < 500])
    assert (top, at) == (250, 4) and [b.size for b in alive] == [100, 70, 40, 40]
    summary = mod.summarise([b for b in buffers if b.size < 500], mod.op_names(HLO), top=5)
    groups = {g["operation"]: (g["buffers"], g["bytes"], g["layers"]) for g in summary["groups"]}
    assert groups == {"jit(step)/layers_*/mlp/mul": (2, 80, [3, 12]), "state.params['layers_*']['w']": (1, 100, [0]),
                      "jit(step)/blocks_*/attn/neg": (1, 70, [1])}
    assert summary["alive_with_op_name"] == 4
    assert summary["groups"][0]["operation"] == "state.params['layers_*']['w']"
