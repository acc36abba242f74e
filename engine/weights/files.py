"""The files of a model folder: Hugging Face's weights (and their index), and those raging
adds to a folder it prepared."""

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded model's: weight name -> shard file
QUANT_FILE = "quant_blocks.safetensors"  # the GGUF's quant blocks (engine.weights.quant_blocks)
QUANT_ROWS_FILE = "quant_rows.json"  # quant row counts measured per machine (quant_rows)
READY_MARKER = ".raging-ready"  # written last: the prepared folder is whole
