"""The training loop, and only the loop.

What happens, and where each concern plugs in::

    setup:  (dtrain.train.wiring.wire_trainer, the one wiring place, builds every component)
            build loader                           # this rank's share of one stream; a fresh
                                                   # start reads its first pieces ahead now
            strategy.setup(task)                  # wrap the model (ddp, allreduce, fsdp, ...)
            build optimizer, LR schedule
            resume(newest valid checkpoint)        # dict of state_dicts -> every component
                                                   # (the loader reads ahead once it is chosen)
    loop:   for step in range(start, steps):      # each phase a `with` (the liveness record)
              balance.step_started()               # per-rank phase timing (balance/)
              batch = next(loader)                 # micro-batches of (inputs, targets)
              balance.data_ready(batch)            # data wait ends
              forward_backward(batch, items, stop flag)      (dtrain.train.step, every strategy)
                  for each micro-batch: loss_fn(model(x), y).sum().backward(scale)
                  strategy.sync_gradients()        # grads = d(global mean loss), synced;
                                                   # the ranks' agreement on the step (global
                                                   # items, stop) rides in the last bucket
              start the logged step's loss sum and, once a timing window, its gather
                                                   # (both complete during the update)
              norm = strategy.clip_grad_norm()     # global norm: the same on every rank
              if norm is finite: optimizer.step()
              scheduler.step()
              strategy.after_optimizer_step(step)  # localsgd, diloco: sync every H steps
              balance.step_finished(step)          # once a window: gather the ranks'
                                                   # timings, name stragglers; new shares
                                                   # for the loader from the next step on
              nan_guard.decide(step, norm)         # a non-finite norm: the step was skipped;
                                                   # after N in a row roll back to the last
                                                   # checkpoint, never to deliver those
                                                   # batches again (the trainer does it)
              every log_every:         a train record to every sink (metrics.jsonl,
                                       progress line, TensorBoard); events as they happen
                                       (all through the RunLog, dtrain.metrics.run_log)
              if any rank was asked to stop: save, exit 0   # all after the same step
              every eval.every:        evaluate (each val sample exactly once)
              every checkpoint.every:  save (async: the loop waits for a snapshot only)
    end:    evaluate, final checkpoint, summary

A collective that fails because a peer died or hung becomes a
:class:`~dtrain.fault.peer_failure.PeerFailure` naming that peer.

============  ==================================================================================
``loop``      :class:`Trainer`: the steps, and what a step's end carries out
``counters``  :class:`Counters`: step, items seen, skipped and rolled-back steps (checkpointed)
``rollback``  the NaN guard's decision carried out: a skipped update counted, a rollback loaded
============  ==================================================================================
"""

from dtrain.train.trainer.counters import Counters
from dtrain.train.trainer.loop import Trainer

__all__ = ["Counters", "Trainer"]
