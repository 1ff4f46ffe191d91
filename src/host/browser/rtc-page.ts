/**
 * The page's half of the node's data channels. Chromium has
 * `RTCPeerConnection` in windows only (not in dedicated workers), while the
 * node runs in a worker: the page owns the peer connections, the worker
 * drives them over a MessagePort (rtc-worker.ts) and gets the channels.
 *
 * A channel is transferred to the worker the moment it exists (Chromium
 * transfers an `RTCDataChannel` only at creation, or inside `ondatachannel`,
 * before any send), so no activation crosses the page's main thread. A
 * browser that cannot transfer one keeps it here and bridges it over a
 * MessagePort of its own (docs/benchmarks.md measures both).
 *
 *   worker → page  {op:'create', id, initiator, iceServers, icePolicy?} | {op:'signal', id, seq, signal} | {op:'close', id}
 *   page → worker  {op:'signal', id, signal} | {op:'channel', id, channel} | {op:'bridge', id, port}
 *                  | {op:'failed', id, reason} | {op:'ack', seq, error?}
 */
import type { IceServer, RtcSignal } from '../../net/rtc-peer.ts';

/** How long ICE may stay 'disconnected' before the connection is given up (see create()). */
const DISCONNECTED_GRACE_MS = 2_000;

export type PageToWorker =
  | { op: 'signal'; id: string; signal: RtcSignal }
  | { op: 'channel'; id: string; channel: RTCDataChannel }
  | { op: 'bridge'; id: string; port: MessagePort }
  | { op: 'failed'; id: string; reason: string }
  | { op: 'ack'; seq: number; error?: string };

export type WorkerToPage =
  | { op: 'create'; id: string; initiator: boolean; iceServers: IceServer[]; icePolicy?: 'relay' }
  | { op: 'signal'; id: string; seq: number; signal: RtcSignal }
  | { op: 'close'; id: string };

/** Bridge messages, page ↔ worker, for a channel the page keeps. */
export type BridgeMessage = { t: 'open' } | { t: 'msg'; data: ArrayBuffer | string } | { t: 'close' } | { t: 'buffered'; bytes: number };

export interface PagePeers {
  /** Peer connections open now. */
  readonly size: number;
  /** How channels reach the worker: 'transfer' (the channel itself) or 'bridge' (a MessagePort through this page); undefined before the first. */
  readonly mode: 'transfer' | 'bridge' | undefined;
  /** Close every peer connection (a test of the fallback: the node's channels close mid-chat). */
  closeAll(): void;
  close(): void;
}

/** Serve the worker's peer-connection requests arriving on `port`. `forceBridge`: never transfer (to measure the bridge). */
export function servePeerConnections(port: MessagePort, opts: { forceBridge?: boolean } = {}): PagePeers {
  const pcs = new Map<string, RTCPeerConnection>();
  let mode: 'transfer' | 'bridge' | undefined;
  const post = (m: PageToWorker, transfer: Transferable[] = []) => port.postMessage(m, transfer);

  function failed(id: string, reason: string): void {
    const pc = pcs.get(id);
    if (!pc) return;
    pcs.delete(id);
    pc.close();
    post({ op: 'failed', id, reason });
  }

  function deliver(id: string, dc: RTCDataChannel): void {
    if (!opts.forceBridge) {
      try {
        post({ op: 'channel', id, channel: dc }, [dc as unknown as Transferable]);
        mode = 'transfer';
        return;
      } catch {
        // Not transferable in this browser: bridge it below.
      }
    }
    mode = 'bridge';
    const mc = new MessageChannel();
    const mine = mc.port1;
    dc.binaryType = 'arraybuffer';
    const tell = (m: BridgeMessage, transfer: Transferable[] = []) => mine.postMessage(m, transfer);
    dc.onopen = () => tell({ t: 'open' });
    dc.onclose = () => tell({ t: 'close' });
    dc.onmessage = (e: MessageEvent) => {
      const data = e.data as ArrayBuffer | string;
      tell({ t: 'msg', data }, typeof data === 'string' ? [] : [data]);
    };
    mine.onmessage = (e: MessageEvent<BridgeMessage>) => {
      const m = e.data;
      if (m.t === 'msg') {
        if (dc.readyState === 'open') dc.send(m.data as ArrayBuffer);
        // The worker reads bufferedAmount from here: its SendGate holds back when the channel backs up.
        tell({ t: 'buffered', bytes: dc.bufferedAmount });
      } else if (m.t === 'close') dc.close();
    };
    post({ op: 'bridge', id, port: mc.port2 }, [mc.port2]);
    if (dc.readyState === 'open') tell({ t: 'open' });
  }

  async function create(id: string, initiator: boolean, iceServers: IceServer[], icePolicy: 'relay' | undefined): Promise<void> {
    const pc = new RTCPeerConnection({ iceServers: iceServers.map((s) => ({ ...s })), ...(icePolicy ? { iceTransportPolicy: icePolicy } : {}) });
    pcs.set(id, pc);
    let candidates = 0;
    pc.onicecandidate = (e) => {
      if (e.candidate && e.candidate.candidate) {
        candidates++;
        post({ op: 'signal', id, signal: { type: 'candidate', candidate: e.candidate.candidate, sdpMid: e.candidate.sdpMid, sdpMLineIndex: e.candidate.sdpMLineIndex } });
      }
    };
    // No candidate at all (no network interface but loopback): no pair can ever form, so
    // say so now rather than after the pool's open timeout; the node stays on the relay.
    pc.onicegatheringstatechange = () => {
      if (pc.iceGatheringState === 'complete' && candidates === 0) failed(id, 'ICE gathered no candidate (no network path for WebRTC here)');
    };
    pc.onconnectionstatechange = () => {
      if (pc.connectionState === 'failed') failed(id, 'ICE failed: no path between the two pages');
      else if (pc.connectionState === 'closed') failed(id, 'the peer connection closed');
    };
    // A page that crashed or froze sends nothing more, not even a close: its channel would look open until ICE
    // gives up (~30 s), and one-way pushes into it would be lost without a word. 'disconnected' (no answer to
    // ICE's checks for ~2.5 s) that lasts DISCONNECTED_GRACE_MS more ends it; the node goes by the relay and
    // dials again later. The grace rides out a busy machine's late checks.
    let disconnected: ReturnType<typeof setTimeout> | undefined;
    pc.oniceconnectionstatechange = () => {
      if (pc.iceConnectionState !== 'disconnected') {
        clearTimeout(disconnected);
        disconnected = undefined;
        return;
      }
      disconnected ??= setTimeout(() => {
        if (pc.iceConnectionState === 'disconnected' && pcs.has(id)) failed(id, 'ICE disconnected: the other page stopped answering');
      }, DISCONNECTED_GRACE_MS);
    };
    if (initiator) {
      // Transferred at once: later, Chromium refuses ("Transfers must occur on creation").
      deliver(id, pc.createDataChannel('meshnet', { ordered: true }));
      await pc.setLocalDescription();
      post({ op: 'signal', id, signal: { type: 'offer', sdp: pc.localDescription!.sdp } });
    } else {
      pc.ondatachannel = (e) => deliver(id, e.channel);
    }
  }

  async function signal(id: string, s: RtcSignal): Promise<void> {
    const pc = pcs.get(id);
    if (!pc) throw new Error(`no peer connection ${id}`);
    if (s.type === 'offer') {
      await pc.setRemoteDescription({ type: 'offer', sdp: s.sdp });
      await pc.setLocalDescription();
      post({ op: 'signal', id, signal: { type: 'answer', sdp: pc.localDescription!.sdp } });
    } else if (s.type === 'answer') {
      await pc.setRemoteDescription({ type: 'answer', sdp: s.sdp });
    } else if (s.type === 'candidate') {
      await pc.addIceCandidate({ candidate: s.candidate, sdpMid: s.sdpMid ?? null, sdpMLineIndex: s.sdpMLineIndex ?? null });
    } else if (s.type === 'close') {
      failed(id, s.reason ?? 'closed by the far side');
    }
  }

  port.onmessage = (e: MessageEvent<WorkerToPage>) => {
    const m = e.data;
    if (m.op === 'create') {
      create(m.id, m.initiator, m.iceServers, m.icePolicy).catch((err: Error) => failed(m.id, `the peer connection could not start: ${err.message}`));
    } else if (m.op === 'signal') {
      signal(m.id, m.signal).then(
        () => post({ op: 'ack', seq: m.seq }),
        (err: Error) => post({ op: 'ack', seq: m.seq, error: err.message }),
      );
    } else if (m.op === 'close') {
      const pc = pcs.get(m.id);
      pcs.delete(m.id);
      pc?.close();
    }
  };

  return {
    get size() {
      return pcs.size;
    },
    get mode() {
      return mode;
    },
    closeAll() {
      for (const id of [...pcs.keys()]) failed(id, 'closed by the page');
    },
    close() {
      for (const pc of pcs.values()) pc.close();
      pcs.clear();
      port.onmessage = null;
      port.close();
    },
  };
}
