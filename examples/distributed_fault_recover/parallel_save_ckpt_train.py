"""The distributed page's parallel_save_ckpt_train.py: the Transformer on dp2 x mp4, each rank saving only its own
slices (integrated_save=False) and its group info (the ranks holding the same slices).

    $ bash examples/distributed_fault_recover/run_parallel_save_ckpt.sh [DATASET_PATH] [options]
    $ mpirun -n 8 python examples/distributed_fault_recover/parallel_save_ckpt_train.py [options]

Options (see transformer_setup.py) shorten it, e.g. --epochs 2 --num_samples 96 --vocab_size 64 --d_model 32.
"""
import transformer_setup as setup

import dsim
from dsim import CheckpointConfig, LossMonitor, ModelCheckpoint, TimeMonitor

args_opt = setup.parse_args(__doc__.splitlines()[0])


def train():
    setup.set_parallel_context(args_opt)
    # model create
    net, optimizer, model = setup.create_model(args_opt)
    dataset = setup.create_dataset(args_opt)
    callback_size = args_opt.callback_size
    # checkpoint save
    ckpt_config = CheckpointConfig(save_checkpoint_steps=callback_size, keep_checkpoint_max=4,
                                   integrated_save=False, append_info=["epoch_num", "step_num"])
    ckpoint_cb = ModelCheckpoint(prefix="test", directory=args_opt.ckpt_dir, config=ckpt_config)
    callback = [TimeMonitor(callback_size), LossMonitor(callback_size), ckpoint_cb]
    model.train(args_opt.epochs, dataset, callbacks=callback, dataset_sink_mode=True)
    if dsim.get_rank() == 0:
        print(f"group info of rank 0: {dsim.restore_group_info_list(args_opt.ckpt_dir + '/rank_0/group_info.json')}")


if __name__ == "__main__":
    train()
