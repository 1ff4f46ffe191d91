/**
 * A small ONNX graph builder over onnx-proto that writes weights straight
 * into the final ModelProto bytes.
 *
 * Why not `ModelProto.encode` with initializers: protobufjs would hold the
 * weights three times (our transposed copy, the message object, the encoded
 * buffer). Here the graph skeleton (nodes, inputs, outputs: a few KiB) goes
 * through onnx-proto, and the initializers are appended as a second
 * occurrence of `ModelProto.graph` — protobuf merges repeated occurrences of
 * an embedded message, so ORT sees one graph — each tensor's bytes produced
 * once, in place, by its `fill` callback. Peak memory while building is one
 * copy of the layer's weights plus one row of scratch.
 *
 * Weights are inline initializers, not external data: onnxruntime-node
 * cannot take external data from memory, onnxruntime-web only through its
 * own `externalData` option, and an inline model is one Uint8Array that both
 * accept the same way. ORT copies initializers out of the proto while it
 * builds the session; the caller drops the bytes afterwards.
 */
import pkg from 'onnx-proto';
import { f32ToF16Bits } from '../protocol/tensor.ts';

const { onnx } = pkg;
type INodeProto = pkg.onnx.INodeProto;
type IValueInfoProto = pkg.onnx.IValueInfoProto;
type IAttributeProto = pkg.onnx.IAttributeProto;

export const OPSET = 17;
const IR_VERSION = 8;

/** ONNX TensorProto.DataType numbers we emit. */
export const ElemType = { FLOAT: 1, UINT8: 2, INT32: 6, INT64: 7, FLOAT16: 10 } as const;
export type ElemTypeId = (typeof ElemType)[keyof typeof ElemType];

/** A dimension: a fixed size or a symbolic name shared across inputs. */
export type Dim = number | string;

type AttrValue = number | number[] | string | { float: number };

export interface Initializer {
  name: string;
  elemType: ElemTypeId;
  dims: number[];
  /** Writes the little-endian element bytes; `dst` has exactly the tensor's size. */
  fill: (dst: Uint8Array) => void;
}

const LE = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

function elemBytes(t: ElemTypeId): number {
  return t === ElemType.INT64 ? 8 : t === ElemType.FLOAT || t === ElemType.INT32 ? 4 : t === ElemType.UINT8 ? 1 : 2;
}

/** onnxruntime's contrib operators (GroupQueryAttention, MatMulNBits, SkipSimplifiedLayerNormalization…). */
export const MS_DOMAIN = 'com.microsoft';

function valueInfo(name: string, elemType: ElemTypeId, dims: Dim[] | null): IValueInfoProto {
  return onnx.ValueInfoProto.create({
    name,
    type: {
      tensorType: {
        elemType,
        ...(dims ? { shape: { dim: dims.map((d) => (typeof d === 'number' ? { dimValue: d } : { dimParam: d })) } } : {}),
      },
    },
  });
}

function attribute(name: string, v: AttrValue): IAttributeProto {
  const A = onnx.AttributeProto.AttributeType;
  if (typeof v === 'number') return onnx.AttributeProto.create({ name, type: A.INT, i: v });
  if (typeof v === 'string') return onnx.AttributeProto.create({ name, type: A.STRING, s: new TextEncoder().encode(v) });
  if (Array.isArray(v)) return onnx.AttributeProto.create({ name, type: A.INTS, ints: v });
  return onnx.AttributeProto.create({ name, type: A.FLOAT, f: v.float });
}

export class GraphBuilder {
  private readonly nodes: INodeProto[] = [];
  private readonly inputs: IValueInfoProto[] = [];
  private readonly outputs: IValueInfoProto[] = [];
  private readonly inits: Initializer[] = [];
  private readonly names = new Set<string>();
  private readonly domains = new Set<string>();
  private counter = 0;
  private readonly externals: Initializer[] = [];

  /**
   * `weightsAsInputs`: initializers of at least `minBytes` become graph
   * inputs instead (`externalWeights()` lists them with their contents), so
   * several sessions can read one copy the caller uploads once (GPU graph
   * capture: a captured decode session and an uncaptured prefill session
   * over the same weights). Small constants (shapes, scalars) stay
   * initializers: kernels need some of them on the CPU at load time.
   */
  constructor(
    private readonly graphName: string,
    private readonly weightsAsInputs?: { minBytes: number },
  ) {}

  /** A fresh value name; `hint` keeps the optimized-model dumps readable. */
  fresh(hint: string): string {
    let name: string;
    do name = `${hint}_${this.counter++}`;
    while (this.names.has(name));
    this.names.add(name);
    return name;
  }

  input(name: string, elemType: ElemTypeId, dims: Dim[]): string {
    this.names.add(name);
    this.inputs.push(valueInfo(name, elemType, dims));
    return name;
  }

  output(name: string, elemType: ElemTypeId, dims: Dim[] | null = null): void {
    this.outputs.push(valueInfo(name, elemType, dims));
  }

  /**
   * One node; returns its output names (named `outNames` when given, else
   * fresh; '' leaves an optional output unset). `domain` '' is ONNX itself.
   */
  op(opType: string, inputs: string[], attrs: Record<string, AttrValue> = {}, outNames: number | string[] = 1, domain = ''): string[] {
    const output = typeof outNames === 'number' ? Array.from({ length: outNames }, () => this.fresh(opType.toLowerCase())) : outNames;
    for (const o of output) if (o) this.names.add(o);
    if (domain) this.domains.add(domain);
    this.nodes.push(
      onnx.NodeProto.create({
        opType,
        ...(domain ? { domain } : {}),
        name: this.fresh(`n_${opType}`),
        input: inputs,
        output,
        attribute: Object.entries(attrs).map(([k, v]) => attribute(k, v)),
      }),
    );
    return output;
  }

  /** Single-output convenience over `op`. */
  op1(opType: string, inputs: string[], attrs: Record<string, AttrValue> = {}, outName?: string, domain = ''): string {
    return this.op(opType, inputs, attrs, outName === undefined ? 1 : [outName], domain)[0]!;
  }

  initializer(name: string, elemType: ElemTypeId, dims: number[], fill: (dst: Uint8Array) => void): string {
    if (this.weightsAsInputs && dims.reduce((a, b) => a * b, 1) * elemBytes(elemType) >= this.weightsAsInputs.minBytes) {
      this.input(name, elemType, dims);
      this.externals.push({ name, elemType, dims, fill });
      return name;
    }
    this.names.add(name);
    this.inits.push({ name, elemType, dims, fill });
    return name;
  }

  /** The weights made graph inputs (see the constructor), in declaration order. */
  externalWeights(): readonly Initializer[] {
    return this.externals;
  }

  constI64(hint: string, values: number[], dims: number[] = [values.length]): string {
    return this.initializer(this.fresh(hint), ElemType.INT64, dims, (dst) => {
      const dv = new DataView(dst.buffer, dst.byteOffset, dst.byteLength);
      values.forEach((v, i) => dv.setBigInt64(i * 8, BigInt(v), true));
    });
  }

  /** A scalar (rank 0) or small constant in float32 or float16. */
  constF(hint: string, values: number[], elemType: ElemTypeId = ElemType.FLOAT, dims: number[] = []): string {
    return this.initializer(this.fresh(hint), elemType, dims, (dst) => writeFloats(dst, Float32Array.from(values), elemType));
  }

  /** Total weight bytes: initializers (what the session will own) and weights made inputs (what the caller holds for it). */
  initializerBytes(): number {
    return [...this.inits, ...this.externals].reduce((s, t) => s + t.dims.reduce((a, b) => a * b, 1) * elemBytes(t.elemType), 0);
  }

  /** ModelProto bytes: skeleton through onnx-proto, then the initializers written in place. */
  encode(): Uint8Array {
    const skeleton = onnx.ModelProto.encode(
      onnx.ModelProto.create({
        irVersion: IR_VERSION,
        producerName: 'meshnet-web',
        opsetImport: [{ domain: '', version: OPSET }, ...[...this.domains].map((domain) => ({ domain, version: 1 }))],
        graph: { name: this.graphName, node: this.nodes, input: this.inputs, output: this.outputs },
      }),
    ).finish();

    const headers = this.inits.map((t) => {
      const dataLen = t.dims.reduce((a, b) => a * b, 1) * elemBytes(t.elemType);
      const head = tensorHeader(t, dataLen);
      return { head, dataLen, msgLen: head.length + dataLen };
    });
    const graphBody = headers.reduce((s, h) => s + 1 + varintLen(h.msgLen) + h.msgLen, 0);
    const total = skeleton.length + (this.inits.length ? 1 + varintLen(graphBody) + graphBody : 0);

    const out = new Uint8Array(total);
    out.set(skeleton, 0);
    let off = skeleton.length;
    if (this.inits.length) {
      out[off++] = (7 << 3) | 2; // ModelProto.graph
      off = writeVarint(out, off, graphBody);
      this.inits.forEach((t, i) => {
        const h = headers[i]!;
        out[off++] = (5 << 3) | 2; // GraphProto.initializer
        off = writeVarint(out, off, h.msgLen);
        out.set(h.head, off);
        off += h.head.length;
        t.fill(out.subarray(off, off + h.dataLen));
        off += h.dataLen;
      });
    }
    if (off !== total) throw new Error(`ONNX encoder wrote ${off} of ${total} bytes`);
    return out;
  }
}

function varintLen(n: number): number {
  let len = 1;
  while (n >= 0x80) {
    n = Math.floor(n / 128);
    len++;
  }
  return len;
}

function writeVarint(dst: Uint8Array, off: number, n: number): number {
  while (n >= 0x80) {
    dst[off++] = (n % 128) | 0x80;
    n = Math.floor(n / 128);
  }
  dst[off++] = n;
  return off;
}

/** TensorProto fields before raw_data: dims (1, packed), data_type (2), name (8), raw_data tag+length (9). */
function tensorHeader(t: Initializer, dataLen: number): Uint8Array {
  const name = new TextEncoder().encode(t.name);
  const dimsLen = t.dims.reduce((s, d) => s + varintLen(d), 0);
  const size =
    (t.dims.length ? 1 + varintLen(dimsLen) + dimsLen : 0) + 1 + varintLen(t.elemType) + 1 + varintLen(name.length) + name.length + 1 + varintLen(dataLen);
  const h = new Uint8Array(size);
  let o = 0;
  if (t.dims.length) {
    h[o++] = (1 << 3) | 2;
    o = writeVarint(h, o, dimsLen);
    for (const d of t.dims) o = writeVarint(h, o, d);
  }
  h[o++] = 2 << 3;
  o = writeVarint(h, o, t.elemType);
  h[o++] = (8 << 3) | 2;
  o = writeVarint(h, o, name.length);
  h.set(name, o);
  o += name.length;
  h[o++] = (9 << 3) | 2;
  writeVarint(h, o, dataLen);
  return h;
}

/** Writes float values as float32 or float16 little-endian bytes into `dst`. */
export function writeFloats(dst: Uint8Array, values: Float32Array, elemType: ElemTypeId, dstOffsetElems = 0): void {
  if (elemType === ElemType.FLOAT) {
    const bytes = new Uint8Array(values.buffer, values.byteOffset, values.byteLength);
    if (LE) dst.set(bytes, dstOffsetElems * 4);
    else {
      const dv = new DataView(dst.buffer, dst.byteOffset);
      values.forEach((v, i) => dv.setFloat32((dstOffsetElems + i) * 4, v, true));
    }
  } else if (elemType === ElemType.FLOAT16) {
    const dv = new DataView(dst.buffer, dst.byteOffset);
    for (let i = 0; i < values.length; i++) dv.setUint16((dstOffsetElems + i) * 2, f32ToF16Bits(values[i]!), true);
  } else throw new Error(`writeFloats: element type ${elemType} is not a float type`);
}
