/**
 * The worker's half of the node's data channels: an RtcFactory (the core's
 * contract, net/rtc-peer.ts) whose peer connections live in the page
 * (rtc-page.ts), reached over a MessagePort the page hands the worker at
 * start. The channel comes back transferred (an RTCDataChannel of this
 * worker), or as a MessagePort bridged by the page.
 */
import type { DataChannelLike, IceServer, RtcFactory, RtcPeerHandle, RtcPeerInit, RtcSignal } from '../../net/rtc-peer.ts';
import { randomHex } from '../../protocol/ids.ts';
import type { BridgeMessage, PageToWorker, WorkerToPage } from './rtc-page.ts';

interface Pending {
  init: RtcPeerInit;
  resolve(ch: DataChannelLike): void;
  reject(e: Error): void;
  settled: boolean;
}

export function pageRtcFactory(port: MessagePort): RtcFactory {
  const peers = new Map<string, Pending>();
  const acks = new Map<number, { resolve(): void; reject(e: Error): void }>();
  let seq = 0;
  const post = (m: WorkerToPage) => port.postMessage(m);

  port.onmessage = (e: MessageEvent<PageToWorker>) => {
    const m = e.data;
    if (m.op === 'ack') {
      const a = acks.get(m.seq);
      acks.delete(m.seq);
      if (m.error !== undefined) a?.reject(new Error(m.error));
      else a?.resolve();
      return;
    }
    const p = peers.get(m.id);
    if (!p) {
      if (m.op === 'channel') m.channel.close();
      return;
    }
    if (m.op === 'signal') p.init.onSignal(m.signal);
    else if (m.op === 'channel') settle(p, () => p.resolve(m.channel as unknown as DataChannelLike));
    else if (m.op === 'bridge') settle(p, () => p.resolve(new BridgedChannel(m.port)));
    else if (m.op === 'failed') {
      peers.delete(m.id);
      if (!p.settled) settle(p, () => p.reject(new Error(m.reason)));
      p.init.onFailed?.(m.reason);
    }
  };

  function settle(p: Pending, f: () => void): void {
    if (p.settled) return;
    p.settled = true;
    f();
  }

  return {
    create(init: RtcPeerInit): RtcPeerHandle {
      const id = randomHex(8);
      let resolve!: (ch: DataChannelLike) => void;
      let reject!: (e: Error) => void;
      const channel = new Promise<DataChannelLike>((res, rej) => {
        resolve = res;
        reject = rej;
      });
      // Nobody may be listening yet when it fails at once.
      channel.catch(() => undefined);
      peers.set(id, { init, resolve, reject, settled: false });
      post({ op: 'create', id, initiator: init.initiator, iceServers: init.iceServers.map((s) => ({ ...s })) as IceServer[], ...(init.icePolicy ? { icePolicy: init.icePolicy } : {}) });
      return {
        channel,
        signal(signal: RtcSignal): Promise<void> {
          return new Promise<void>((res, rej) => {
            const n = ++seq;
            acks.set(n, { resolve: res, reject: rej });
            post({ op: 'signal', id, seq: n, signal });
          });
        },
        close() {
          const p = peers.get(id);
          peers.delete(id);
          if (p && !p.settled) settle(p, () => p.reject(new Error('closed')));
          post({ op: 'close', id });
        },
      };
    },
  };
}

/** A channel the page keeps, seen through its bridge port. */
class BridgedChannel implements DataChannelLike {
  binaryType = 'arraybuffer';
  readyState: DataChannelLike['readyState'] = 'connecting';
  bufferedAmount = 0;
  onopen: ((ev: unknown) => void) | null = null;
  onmessage: ((ev: { data: unknown }) => void) | null = null;
  onclose: ((ev: unknown) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;

  constructor(private readonly port: MessagePort) {
    port.onmessage = (e: MessageEvent<BridgeMessage>) => {
      const m = e.data;
      if (m.t === 'open') {
        this.readyState = 'open';
        this.onopen?.({});
      } else if (m.t === 'msg') this.onmessage?.({ data: m.data });
      else if (m.t === 'buffered') this.bufferedAmount = m.bytes;
      else if (m.t === 'close') this.closed();
    };
  }

  send(data: string | Uint8Array | ArrayBuffer): void {
    if (this.readyState !== 'open') throw new Error('the data channel is not open');
    if (typeof data === 'string') this.port.postMessage({ t: 'msg', data } satisfies BridgeMessage);
    else {
      // A copy the port can take: the caller may reuse its buffer.
      const bytes = data instanceof ArrayBuffer ? new Uint8Array(data).slice() : data.slice();
      this.port.postMessage({ t: 'msg', data: bytes.buffer } satisfies BridgeMessage, [bytes.buffer]);
    }
  }

  close(): void {
    if (this.readyState === 'closed') return;
    this.port.postMessage({ t: 'close' } satisfies BridgeMessage);
    this.closed();
  }

  private closed(): void {
    if (this.readyState === 'closed') return;
    this.readyState = 'closed';
    this.onclose?.({});
    this.port.close();
  }
}
