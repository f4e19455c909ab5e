#!/usr/bin/env python3
"""Run SCALE-Sim v3 on a list of layers and print cycle counts as JSON.

Input (stdin, JSON): {"rows": R, "cols": C, "layers": [
    {"name": "...", "kind": "gemm", "m": M, "k": K, "n": N} |
    {"name": "...", "kind": "conv", "h": H, "w": W, "kh": KH, "kw": KW,
     "cin": CIN, "cout": COUT, "stride": S}]}
Output (stdout, JSON): {"cycles": {name: total_cycles}, "wall_seconds": t}

Weight-stationary dataflow, SRAM buffers large enough that the array never
stalls on memory (SCALE-Sim's "Total Cycles" is then pure compute).
Needs `pip install scalesim 'numpy<2'` (scripts/setup-bench.sh does it).
"""
import contextlib
import csv
import io
import json
import os
import sys
import tempfile
import time

from scalesim.scale_sim import scalesim

CFG = """[general]
run_name = vnpu_cmp

[architecture_presets]
ArrayHeight:    {rows}
ArrayWidth:     {cols}
IfmapSramSzkB:  1048576
FilterSramSzkB: 1048576
OfmapSramSzkB:  1048576
IfmapOffset:    0
FilterOffset:   10000000
OfmapOffset:    20000000
Bandwidth : 10000
Dataflow : ws
MemoryBanks:   1
ReadRequestBuffer: 32
WriteRequestBuffer: 32

[layout]
IfmapCustomLayout: False
IfmapSRAMBankBandwidth: 10000
IfmapSRAMBankNum: 1
IfmapSRAMBankPort: 2
FilterCustomLayout: False
FilterSRAMBankBandwidth: 10000
FilterSRAMBankNum: 1
FilterSRAMBankPort: 2

[sparsity]
SparsitySupport : false
SparseRep : ellpack_block
OptimizedMapping : false
BlockSize : 8
RandomNumberGeneratorSeed : 40

[run_presets]
InterfaceBandwidth: USER
UseRamulatorTrace: False
"""


def main():
    spec = json.load(sys.stdin)
    out = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "scale.cfg")
        with open(cfg, "w") as f:
            f.write(CFG.format(rows=spec["rows"], cols=spec["cols"]))
        for layer in spec["layers"]:
            topo = os.path.join(d, layer["name"] + ".csv")
            layout = os.path.join(d, layer["name"] + "_layout.csv")
            with open(topo, "w") as f:
                if layer["kind"] == "gemm":
                    f.write("Layer, M, N, K,\n")
                    f.write(f'{layer["name"]}, {layer["m"]}, {layer["n"]}, {layer["k"]},\n')
                    gemm = True
                else:
                    f.write("Layer name, IFMAP Height, IFMAP Width, Filter Height, Filter Width, Channels, Num Filter, Strides,\n")
                    f.write(f'{layer["name"]}, {layer["h"]}, {layer["w"]}, {layer["kh"]}, {layer["kw"]}, '
                            f'{layer["cin"]}, {layer["cout"]}, {layer["stride"]},\n')
                    gemm = False
            with open(layout, "w") as f:
                f.write("Layer name, a, b, c, d, e, f, g, h,\n")
                f.write(f'{layer["name"]}, 1, 1, 1, 1, 1, 1, 1, 1,\n')
            logdir = os.path.join(d, "out_" + layer["name"])
            sim = scalesim(save_disk_space=True, verbose=False, config=cfg, topology=topo,
                           layout=layout, input_type_gemm=gemm)
            with contextlib.redirect_stdout(io.StringIO()):
                sim.run_scale(top_path=logdir)
            report = None
            for root, _, files in os.walk(logdir):
                if "COMPUTE_REPORT.csv" in files:
                    report = os.path.join(root, "COMPUTE_REPORT.csv")
            with open(report) as f:
                rows = list(csv.reader(f))
            header = [h.strip() for h in rows[0]]
            col = header.index("Total Cycles")
            out[layer["name"]] = int(float(rows[1][col]))
    json.dump({"cycles": out, "wall_seconds": time.perf_counter() - t0}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
