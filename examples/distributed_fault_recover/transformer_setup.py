"""What the distributed page's two scripts share (the sample's model.py, dataset.py and argument parsing).

The encoder-decoder Transformer of `distributed_training_transformer`, sliced over dp x mp ranks by its layers
(attention heads and feed-forward split over model parallel, LayerNorm and the head replicated), the toy
translation task made from the seed (or `source<TAB>target` lines of --dataset_path), AdamWeightDecay with
the sample's decay groups (no decay on LayerNorm and biases).
"""
import argparse

import dsim
from dsim import nn
from dsim.dataset import TranslationDataset


def parse_args(description):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dataset_path", default=None, help="source<TAB>target lines (default: the toy task)")
    parser.add_argument("--ckpt_dir", default="./ckpt", help="where the sharded checkpoints go")
    parser.add_argument("--ckpt_file", default=None,
                        help="recover: the checkpoint file of each rank, {rank} for its rank, e.g. ckpt/rank_{rank}/test-1_3.h5")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--callback_size", type=int, default=1, help="a checkpoint every this many steps")
    parser.add_argument("--num_samples", type=int, default=2464, help="toy task size (77 steps of 32)")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--data_parallel", type=int, default=2)
    parser.add_argument("--model_parallel", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=20000)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--num_heads", type=int, default=8)
    parser.add_argument("--ffn_hidden_size", type=int, default=None)
    parser.add_argument("--seq_length", type=int, default=10)
    return parser.parse_args()


def set_parallel_context(args):
    """TransformerOpParallelConfig(data_parallel, model_parallel, vocab_emb_dp=True) and init()."""
    dsim.set_auto_parallel_context(data_parallel=args.data_parallel, model_parallel=args.model_parallel,
                                   vocab_emb_dp=True)
    dsim.init()


def create_model(args):
    """(net, optimizer, model): the Transformer, AdamWeightDecay(lr 1e-4, decay 0.1) and Model; the network's own
    loss is the sample's cross-entropy over the target tokens that are not padding."""
    net = nn.Transformer(vocab_size=args.vocab_size, d_model=args.d_model, num_heads=args.num_heads,
                         ffn_hidden_size=args.ffn_hidden_size, src_len=args.seq_length, tgt_len=args.seq_length)
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-4, weight_decay=0.1)
    return net, optimizer, dsim.Model(net, optimizer=optimizer)


def create_dataset(args):
    dataset = TranslationDataset(args.num_samples, args.seq_length, args.seq_length, args.vocab_size,
                                 path=args.dataset_path)
    return dataset.batch(args.batch_size)
