/**
 * The page's end of the node worker: a NodeEngine that forwards each call
 * through Comlink. Pending calls settle when the worker dies (Comlink's own
 * resolver map never rejects), so the page never waits forever.
 */
import { proxy, wrap, releaseProxy, transfer, type Remote } from 'comlink';
import type { DonorSettings, DrainBeacon, NodeConfig, NodeEngine, NodeStatus, PageLifecycleEvent } from './engine.ts';
import './transfer.ts';

export interface WorkerEngine extends NodeEngine {
  /** Ends the worker; later calls reject with MESH_ERR_SHUTTING_DOWN. */
  terminate(): void;
}

function codedError(code: string, message: string): Error {
  return Object.assign(new Error(message), { code });
}

export function createWorkerEngine(worker: Worker): WorkerEngine {
  const remote: Remote<NodeEngine> = wrap<NodeEngine>(worker);
  let dead: Error | undefined;
  const rejectors = new Set<(e: Error) => void>();
  const die = (e: Error) => {
    if (dead) return;
    dead = e;
    for (const r of rejectors) r(e);
    rejectors.clear();
  };
  worker.addEventListener('error', (ev) => die(codedError('MESH_ERR_INTERNAL', `the node worker crashed: ${ev.message || 'unknown error'}; reload the page`)));

  const call = <T>(f: () => Promise<T>): Promise<T> => {
    if (dead) return Promise.reject(dead);
    return new Promise<T>((resolve, reject) => {
      rejectors.add(reject);
      f().then(resolve, reject).finally(() => rejectors.delete(reject));
    });
  };

  return {
    start: (config: NodeConfig) => call(() => remote.start(config) as Promise<NodeStatus>),
    retry: () => call(() => remote.retry() as Promise<NodeStatus>),
    pause: () => call(() => remote.pause()),
    resume: () => call(() => remote.resume()),
    setMemoryBudget: (bytes: number) => call(() => remote.setMemoryBudget(bytes)),
    setDonor: (patch: Partial<Omit<DonorSettings, 'paused'>>) => call(() => remote.setDonor(patch)),
    setPower: (charging: boolean) => call(() => remote.setPower(charging)),
    // Posted synchronously (Comlink's call posts its message before returning): the freeze handler's message leaves before the page stops.
    lifecycle: (event: PageLifecycleEvent) => call(() => remote.lifecycle(event)),
    onDrainBeacon: (sink: (b: DrainBeacon) => void) => call(() => remote.onDrainBeacon(proxy(sink))),
    status: () => call(() => remote.status() as Promise<NodeStatus>),
    stop: () => call(() => remote.stop()),
    attachPeerConnections: (port: MessagePort) => call(() => remote.attachPeerConnections(transfer(port, [port]))),
    closeDataChannels: () => call(() => remote.closeDataChannels()),
    trace: (on: boolean) => call(() => remote.trace(on)),
    terminate() {
      remote[releaseProxy]();
      worker.terminate();
      die(codedError('MESH_ERR_SHUTTING_DOWN', 'the node worker was stopped'));
    },
  };
}
