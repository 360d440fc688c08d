"""Pre-train a boost-hf model from a YAML recipe; any field can be overridden on the command line.

    python recipes/pretrain.py recipes/demo.yaml --max_steps 100
    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml recipes/pretrain.py recipes/demo.yaml --tp_size 2

The same as ``boost-hf train RECIPE.yaml`` (an installed package ships these recipes: ``boost-hf train demo``);
the steps are :func:`boost_hf.training.pretrain.main`.
"""

import sys

from boost_hf.training.pretrain import main

if __name__ == "__main__":
    main(sys.argv[1:])
