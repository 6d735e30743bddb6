#!/bin/bash
# Test data: Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh as of NVIDIA/Megatron-LM 0b9bc2088b (the last version with --rampup-batch-size; later ones use --step-batch-size-schedule), run by bash as written
# (tests/test_megatron_lm_scripts.py; the launcher is replaced by a shim that hands the program's arguments to
# megatron-sat's trainer). Changed from the script, and only these (everything else is its text):
#   sizes:      --num-layers 96 -> 2, --hidden-size 12288 -> 64, --num-attention-heads 96 -> 4, --seq-length and
#               --max-position-embeddings 2048 -> 32, --global-batch-size 1536 -> 4, --rampup-batch-size
#               16 16 5859375 -> 2 2 2, --tensor-model-parallel-size 8 -> 1, --pipeline-model-parallel-size 16 -> 1
#   iterations: --train-iters 500000 -> --train-samples 6 (Megatron-LM itself refuses a ramp-up with --train-iters),
#               --lr-decay-iters 430000 -> 2, --log-interval 100 -> 1, --save-interval 10000 -> 100,
#               --eval-interval 1000 -> 100, --eval-iters 10 -> 1
#   paths:      $3 and $4 (gpt2-vocab.json, gpt2-merges.txt: --vocab-file, --merge-file) -> $3 a Hugging Face
#               tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model), $4 the data prefix
#   GPU-only:   --fp16 -> --bf16 (bf16 runs on CPU too)

# Runs the "175B" parameter model

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=6000
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CHECKPOINT_PATH=$1 #<Specify path>
TENSORBOARD_LOGS_PATH=$2 #<Specify path>
TOKENIZER_MODEL=$3

DATA_PATH=$4 #<Specify path and file prefix>_text_document

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE 
    --nnodes $NUM_NODES 
    --master_addr $MASTER_ADDR 
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 2 
    --hidden-size 64 
    --num-attention-heads 4 
    --seq-length 32 
    --max-position-embeddings 32 
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1 
    --global-batch-size 4 
    --rampup-batch-size 2 2 2 
    --train-samples 6 
    --weight-decay 0.1 
    --adam-beta1 0.9 
    --adam-beta2 0.95 
    --init-method-std 0.006 
    --clip-grad 1.0 
    --bf16
    --lr 6.0e-5 
    --lr-decay-style cosine 
    --min-lr 6.0e-6
    --lr-warmup-fraction .001 
    --lr-decay-iters 2 
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 1 
	--pipeline-model-parallel-size 1 
)

DATA_ARGS=(
    --data-path $DATA_PATH 
    --tokenizer-type HuggingFaceTokenizer 
    --tokenizer-model $TOKENIZER_MODEL 
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 100 
    --eval-interval 100 
    --save $CHECKPOINT_PATH 
    --load $CHECKPOINT_PATH 
    --eval-iters 1
    --tensorboard-dir $TENSORBOARD_LOGS_PATH 
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
