"""Everything that is not serving: training, the simulator, benchmarks, the demo, the embedded
llama.cpp backend, bulk prediction and replay. The serving path never imports this package.
"""
