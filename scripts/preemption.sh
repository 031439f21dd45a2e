# Sourced by launch_torchrun.sh and launch_slurm.sbatch: the one place where the preemption
# signal, torchrun's agent and the checkpoint are made to fit together.
#
#   t = 0     SIGTERM. Under Slurm, SCAPE_SIGNAL_LEAD_S before the time limit
#             (launch_slurm.sbatch: "#SBATCH --signal=TERM@300", which must equal it; Slurm may
#             send it up to 60 s earlier, never later). Slurm signals every process of the step;
#             torchrun's agent forwards the signal to its workers once more: the trainer takes a
#             repeat within seconds as the same request (scape_train/preemption.py).
#   then      each worker finishes its step, writes the checkpoint and exits 0.
#   t = TORCH_ELASTIC_SHUTDOWN_TIMEOUT   the agent SIGKILLs workers still running (torch's default
#             is 30 s, less than a Llama-1.8B save: rank 0 writes and hashes 22 GB).
#   t = SCAPE_SIGNAL_LEAD_S              Slurm's time limit ends the job.
#
# So: step + slowest save < TORCH_ELASTIC_SHUTDOWN_TIMEOUT < SCAPE_SIGNAL_LEAD_S. 240 s leaves a
# 22 GB save ~90 MB/s of disk and hashing; the trainer warns when one save took more than half of
# it (raise both numbers together then). tests/test_faults_kill.py checks the order and a slow
# save under a real torchrun.
SCAPE_SIGNAL_LEAD_S=300
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}
