"""Fault campaigns: which recovery scheme wins under a given failure rate, measured on real jobs.

    $ python -m dsim.campaign --mtbf 30s --duration 10m --faults kill,uce,corrupt \\
          --strategy periodic,ttp,arf --save-every 10,50 --seed 1 -o campaign

One module per idea:
- failures:   the random failure process (exponential inter-failure times, victim, point in the step, kind)
              drawn from the seed, and the fault plan file the jobs read (dsim.faults, fault.kind: plan);
- strategies: the recovery schemes (periodic, ttp, arf, elastic, peer): what each job is started with;
- hosts:      on real hosts (--cluster HxS): the test cluster, its hostfiles, host crashes and the hosts left;
- jobs:       one training job through the launch scripts, in its own process group, with a timeout;
- runner:     a combination (strategy x interval) run until its wall-clock budget is spent, restarting
              jobs as the strategy says; and the fault-free reference run;
- analysis:   a combination's figures from the job's own metrics.jsonl and checkpoints;
- scale:      the what-if at 1,024 ... 65,536 ranks from the measured costs (no MPI);
- report:     the table, report.json and the timeline picture.
"""
