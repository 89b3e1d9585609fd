"""The distributed page's parallel_recover_train.py: build the model, load each rank's slices of a checkpoint (from
a replica rank when its own file is lost: the group info names them), and continue training.

    $ bash examples/distributed_fault_recover/run_parallel_recover_ckpt.sh [DATASET_PATH] --ckpt_file 'ckpt/rank_{rank}/test-1_77.h5'
    $ mpirun -n 8 python examples/distributed_fault_recover/parallel_recover_train.py --ckpt_file 'ckpt/rank_{rank}/test-1_77.h5'

{rank} in --ckpt_file is each rank's own; the other options are parallel_save_ckpt_train.py's (use the same).
"""
import os

import transformer_setup as setup

import dsim
from dsim import CheckpointConfig, LossMonitor, ModelCheckpoint, TimeMonitor

args_opt = setup.parse_args(__doc__.splitlines()[0])


def find_ckpt_file(pattern, rank):
    """This rank's file, or when it is lost, the same checkpoint's file of a rank its group info names: the
    weight slices of the ranks in that list are the same and can replace each other."""
    ckpt_file = pattern.format(rank=rank)
    if os.path.exists(ckpt_file):
        return ckpt_file
    group_info = os.environ.get("GROUP_INFO_FILE", os.path.join(os.path.dirname(ckpt_file), "group_info.json"))
    rank_list = dsim.restore_group_info_list(group_info.format(rank=rank))
    for other in rank_list:
        if os.path.exists(pattern.format(rank=other)):
            print(f"rank {rank}: {ckpt_file} is lost; loading rank {other}'s (group info {rank_list})", flush=True)
            return pattern.format(rank=other)
    raise FileNotFoundError(f"{ckpt_file}: lost, and no rank of its group info {rank_list} has the file")


def recover_train():
    setup.set_parallel_context(args_opt)
    # model create
    net, optimizer, model = setup.create_model(args_opt)
    dataset = setup.create_dataset(args_opt)
    callback_size = args_opt.callback_size
    ckpt_config = CheckpointConfig(save_checkpoint_steps=callback_size, keep_checkpoint_max=4,
                                   integrated_save=False, append_info=["epoch_num", "step_num"])
    ckpoint_cb = ModelCheckpoint(prefix="test", directory=args_opt.ckpt_dir, config=ckpt_config)
    callback = [TimeMonitor(callback_size), LossMonitor(callback_size), ckpoint_cb]
    # checkpoint load
    initial_epoch = 0
    if args_opt.ckpt_file:
        param_dict = dsim.load_checkpoint(find_ckpt_file(args_opt.ckpt_file, dsim.get_rank()))
        model.build(train_dataset=dataset, epoch=args_opt.epochs)
        dsim.load_param_into_net(net, param_dict)
        dsim.load_param_into_net(optimizer, param_dict)  # the Adam moments and step counter too: an exact resume
        dataset.set_init_step(int(param_dict["step_num"]))  # the next batch, mid-epoch too
        initial_epoch = int(param_dict["step_num"]) // dataset.get_dataset_size()
    model.train(args_opt.epochs, dataset, callbacks=callback, initial_epoch=initial_epoch, dataset_sink_mode=True)


if __name__ == "__main__":
    recover_train()
