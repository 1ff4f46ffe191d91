/**
 * What a host gives the node core to open WebRTC data channels: the
 * contract between the host-free channel pool (rtc-pool.ts) and whatever
 * owns an `RTCPeerConnection`. In a browser that is the page's main thread
 * (Chromium exposes `RTCPeerConnection` to windows only), which hands the
 * worker the channel itself (a transferable `RTCDataChannel`) or, where the
 * browser cannot transfer one, a MessagePort bridged to it. The core never
 * sees the peer connection: it passes signals through and receives a
 * channel.
 */

/** A signal one peer connection hands the other (over the relay; docs/protocol.md §12). */
export type RtcSignal =
  | { type: 'offer' | 'answer'; sdp: string }
  | { type: 'candidate'; candidate: string; sdpMid?: string | null; sdpMLineIndex?: number | null }
  /** The far side stopped (closed its connection, or gave up on it). */
  | { type: 'close'; reason?: string };

/** An ICE server as RTCPeerConnection takes it (STUN/TURN), passed through unchanged. */
export interface IceServer {
  urls: string | string[];
  username?: string;
  credential?: string;
}

/** The subset of RTCDataChannel (or of a bridge standing in for one) that the core uses. */
export interface DataChannelLike {
  binaryType: string;
  readonly readyState: 'connecting' | 'open' | 'closing' | 'closed';
  readonly bufferedAmount: number;
  send(data: string | Uint8Array | ArrayBuffer): void;
  close(): void;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: unknown) => void) | null;
  onerror: ((ev: unknown) => void) | null;
}

export interface RtcPeerInit {
  /** True: this side creates the channel and the offer. */
  initiator: boolean;
  iceServers: readonly IceServer[];
  /** 'relay': ICE through the TURN servers only; the host's own addresses are never offered. */
  icePolicy?: 'relay';
  /** A signal for the far side (offer/answer/candidates), in the order the peer connection produced them. */
  onSignal(signal: RtcSignal): void;
  /** The peer connection failed or closed (ICE failed, the host shut it): the channel will not open, or is gone. */
  onFailed?(reason: string): void;
}

/** One peer connection, owned by the host. */
export interface RtcPeerHandle {
  /** A signal from the far side (answer, offer, candidates). Rejects when the peer connection refuses it. */
  signal(signal: RtcSignal): Promise<void>;
  /**
   * The data channel, once the host has it (transferred to the core's
   * context: it may still be `connecting`). Rejects when the peer connection
   * failed first.
   */
  readonly channel: Promise<DataChannelLike>;
  /** Close the peer connection (and the channel). */
  close(): void;
}

/** Makes peer connections; a host without WebRTC gives none. */
export interface RtcFactory {
  create(init: RtcPeerInit): RtcPeerHandle;
}
