/**
 * A heartbeat that names in `same` the fields it left out (docs/protocol.md
 * §9): they are as in the last message of this node the tracker applied, so
 * they are taken from its record. A node resends them unchanged on nearly
 * every beat (its key, its info, its addresses, an idle node's stats), and
 * parsing and comparing them was a good part of a beat's cost here.
 */
import { MeshError } from '../protocol/errors.ts';
import type { NodeBeat, NodeMessage } from '../protocol/tracker.ts';
import type { NodeRecord } from './node-record.ts';

/**
 * `msg` with the fields its `same` names filled in from `rec` (the record's
 * own objects: the registry's comparisons then see them unchanged at once,
 * and `stats` is absorbed again as if sent); `msg` itself, filled in place.
 * No `same`: `msg` as it is. `rec` undefined with `same`: 404, as for any
 * heartbeat of a node this tracker does not know (the node registers in full).
 */
export function filledBeat(msg: NodeBeat, rec: NodeRecord | undefined): NodeMessage {
  const same = msg.same;
  if (same === undefined) return msg as NodeMessage;
  if (!rec) throw notRegistered(msg.peer_id);
  for (const name of same) {
    switch (name) {
      case 'public_key':
        msg.public_key = rec.publicKey;
        break;
      case 'info':
        msg.info = rec.info;
        break;
      case 'relay_addr':
        if (rec.relayAddr !== undefined) msg.relay_addr = rec.relayAddr;
        break;
      case 'endpoint':
        if (rec.endpoint !== undefined) msg.endpoint = rec.endpoint;
        break;
      case 'stats':
        if (rec.stats !== undefined) msg.stats = rec.stats;
        break;
      case 'stored':
        // Kept by no record: only a registration uses it, and a registration sends every field.
        break;
    }
  }
  return msg as NodeMessage;
}

export function notRegistered(peerId: string): MeshError {
  return new MeshError('MESH_ERR_NOT_FOUND', `peer ${peerId} is not registered here (tracker restarted or node expired); register again`);
}
