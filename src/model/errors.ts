/**
 * A checkpoint that cannot be used as-is. Always names the file (and the
 * tensor when one is at fault): "bad model" with no location is useless to a
 * volunteer staring at a stuck download.
 */
export class ModelFormatError extends Error {
  readonly file: string;
  readonly tensor: string | undefined;

  constructor(file: string, message: string, tensor?: string) {
    super(`${file}${tensor !== undefined ? ` [${tensor}]` : ''}: ${message}`);
    this.name = 'ModelFormatError';
    this.file = file;
    this.tensor = tensor;
  }
}
