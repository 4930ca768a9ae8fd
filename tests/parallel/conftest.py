import os
import sys

# The spawned ranks import the helper modules (_cp_dist, _cp_cases) by name.
sys.path.insert(0, os.path.dirname(__file__))
