"""Engine benchmark script: the same as `jaxstream bench` (see jaxstream/engine/benchmark.py).

    python benchmarks/engine.py --config tiny --random-weights --streams 64,256 --seconds 10
    python benchmarks/engine.py --config voxtral-4b --random-weights --streams 64,128,256 --seconds 60
"""
import sys

from jaxstream.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
